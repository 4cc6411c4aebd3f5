"""``pybmoe demo``: cache off against cache on, on the embedded model, with a loopback RPC device
(:mod:`pybmoe.engine.demo`), then the disk tier against mmap on a model larger than a memory limit
(:func:`pybmoe.engine.demo.run_stream_demo`); ``--route-replay granite`` replays the bundled granite routing trace
(:mod:`pybmoe.routing.granite`) on a model of its shape."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import engine
from ..engine import demo
from ..routing import granite


def run_demo(model: Path | None = None, slots: int | None = None, inserts: int = 0,
             prompt: str = demo.DEFAULT_PROMPT, n_predict: int = 64, out=print,
             route_replay: str | None = None, progress=demo.say) -> tuple[demo.RunResult, demo.RunResult]:
    """:func:`pybmoe.engine.demo.run_demo`, where ``route_replay`` may also be ``"granite"``: the
    bundled granite-3.0-1b-a400m routing trace replayed on a model of its shape (24 layers, 32
    experts, top-8; ``model`` when given), with a prompt of the trace's prefill length, so the hit
    rate reflects real routing locality rather than random weights. ``progress`` gets the progress lines
    (default: stderr), one before a model is written.

    The engine does not read routing traces (the layer rule of ``tests/test_layering.py``): the
    trace is turned into the engine's replay file here, one layer above both.
    """
    if route_replay == "granite":
        from .. import models
        demo.ensure_cached_model(models.GRANITE_TRACE_SPEC, "the granite-shaped model", progress)
        gmodel, csv, n_prompt = granite.granite_replay()
        req = [1000 + i for i in range(n_prompt)]  # token ids: the trace's prefill length
        return demo.run_demo(Path(model) if model else gmodel, slots, inserts, req, n_predict, out,
                             route_replay=csv, progress=progress)
    return demo.run_demo(model, slots, inserts, prompt, n_predict, out, route_replay=route_replay, progress=progress)


def check_args(a: argparse.Namespace) -> None:
    """Every argument of ``pybmoe demo``, checked before any work (no model is generated, no server
    started): slots and inserts >= 0, at least 2 tokens, a non-empty prompt, a disk-tier limit of
    at least 16 MiB, a ``--model`` that is a MoE GGUF, a ``--route-replay`` that is ``granite`` or a file.

    Raises:
        ValueError: a value out of its range, or a model that is not a MoE GGUF (the message names the
            option and what it accepts).
        FileNotFoundError: a ``--model`` or ``--route-replay`` file that is not there.
    """
    from .. import models
    for flag, v, lo, unit in (("--slots", a.slots, 0, "slots per layer"), ("--inserts", a.inserts, 0, "uploads"),
                              ("-n/--n-predict", a.n_predict, 2, "tokens"),
                              ("--disk-limit-mb", a.disk_limit_mb, 16, "MiB")):
        if v is not None and v < lo:
            raise ValueError(f"{flag} {v}: accepted: an integer >= {lo} ({unit})")
    if not a.prompt:
        raise ValueError("-p/--prompt is empty: accepted: a text of at least one character")
    if a.model is not None:
        if not a.model.is_file():
            raise FileNotFoundError(f"-m/--model {a.model}: no such file")
        models.read_spec(a.model)  # a MoE GGUF (the header only); ValueError otherwise
    if a.route_replay not in (None, "granite") and not Path(a.route_replay).is_file():
        raise FileNotFoundError(f"--route-replay {a.route_replay}: no such file; accepted: granite, or a --moe-trace CSV")


#: The description ``pybmoe demo --help`` prints (times: the 2-core project machine, models already written).
DESCRIPTION = f"""\
Two parts, on any machine (no GPU or network needed), each checking that its output
is identical.

1. The expert cache (about 6 s; about 75 s with --route-replay granite): one greedy
   request on the embedded tiny qwen3moe model (random weights: the text is noise),
   answered by llama-server with the cache off and on, every layer on a loopback
   ggml-rpc-server standing in for the GPU and the experts in host memory; the texts
   must be byte-identical, and the hit rate is reported.
2. The disk tier (about 30 s): a {demo.STREAM_DEMO_MIB} MiB model under a {demo.STREAM_DEMO_LIMIT_MIB} MiB memory limit,
   decoded from a cold page cache by stock mmap and by --moe-stream-cache-mb auto;
   the ratio of their decode speeds is reported (one run each: it swings with the
   machine's load), and their tokens and logits must be identical.

A first run also writes the two models into the model cache (a few seconds each).
The results go to stdout; a progress line goes to stderr before each slow step.
Exit status: 0 when both outputs are identical, 1 when one differs, 2 for a bad
argument or a run that failed."""


def parser() -> argparse.ArgumentParser:
    """The parser of ``pybmoe demo``: :data:`DESCRIPTION` and every option, each with its help."""
    ap = argparse.ArgumentParser(prog="pybmoe demo", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path,
                    help="the first part's MoE GGUF (default: the embedded tiny qwen3moe, 4 layers, 16 experts, top-4)")
    ap.add_argument("--slots", type=int, help="expert cache slots per layer of the cache-on run (default: half the "
                                              "model's experts)")
    ap.add_argument("--inserts", type=int, default=0,
                    help="expert uploads per layer per decode step of the cache-on run (default 0 = unlimited)")
    ap.add_argument("-n", "--n-predict", type=int, default=64,
                    help="tokens the first part generates, at least 2 (default: 64)")
    ap.add_argument("-p", "--prompt", default=demo.DEFAULT_PROMPT,
                    help="the first part's prompt, a text (default: a sentence about the expert cache); with "
                         "--route-replay granite the prompt is the trace's prefill length of token ids instead")
    ap.add_argument("--route-replay", metavar="granite|FILE",
                    help="replay real routing: 'granite' = the bundled granite-3.0-1b-a400m trace on a model of its "
                         "shape (24 layers, 32 experts, top-8); or a --moe-trace CSV for the model")
    ap.add_argument("--no-disk-tier", action="store_true",
                    help="skip the second part: the disk tier (--moe-stream-cache-mb) against mmap on a model larger "
                         "than a memory limit")
    ap.add_argument("--disk-limit-mb", type=int, default=demo.STREAM_DEMO_LIMIT_MIB,
                    help=f"the second part's memory limit, MiB (default {demo.STREAM_DEMO_LIMIT_MIB})")
    return ap


def main(argv: list[str] | None = None) -> int:
    """``pybmoe demo [OPTIONS]`` (:data:`DESCRIPTION`); returns the exit status: 0 when both parts'
    outputs are identical, 1 when one differs, 2 for a bad argument or a failed run (one line on stderr)."""
    a = parser().parse_args(argv)
    try:
        check_args(a)
        off, on = run_demo(a.model, a.slots, a.inserts, a.prompt, a.n_predict, route_replay=a.route_replay)
        same = off.text == on.text
        if not a.no_disk_tier:
            print()
            same = demo.run_stream_demo(limit_mib=a.disk_limit_mb).identical and same
    except (engine.EngineError, ValueError, FileNotFoundError) as e:
        print(f"pybmoe demo: error: {e}", file=sys.stderr)
        return 2
    return 0 if same else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
