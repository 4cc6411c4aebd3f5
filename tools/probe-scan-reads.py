#!/usr/bin/env python3
"""How fast can a prefill pass read a layer's experts? (docs/benchmarks/span-reads-2026-12-05/README.md)

    python tools/probe-scan-reads.py MODEL.gguf [FRACTION]      # FRACTION of each layer's experts, default 0.87

A prefill ubatch of pp32 wants 63-87 % of each layer's experts (docs/stream-tier.md, "The scan guard").
For every layer in turn, one layer step at a time as the stream tier reads them, four ways, in rotating
order, three rounds, the file's page cache dropped (POSIX_FADV_DONTNEED) before each:

- direct: each wanted expert projection on its own, O_DIRECT, its aligned window, on 4 lanes from one
  queue;
- seq:    the whole of each layer's expert tensors, buffered, 8 MiB reads on one lane (the kernel's
  readahead, as stock mmap gets it), each range dropped from the page cache after it is read;
- seqd:   the same ranges, O_DIRECT, 8 MiB aligned windows, one lane;
- seqd4:  the same on 4 lanes;
- runsd:  what the tier's reader does (llama_moe_stream::read_jobs): per projection tensor, runs of
  consecutive wanted experts cut at ~8 MiB, O_DIRECT, 4 lanes;
- runsb / runsb4: the same runs read buffered (8 MiB pieces, dropped after), on 1 / 4 lanes.

Prints MiB/s (bytes read / seconds; seq and seqd read the whole layer, direct only the wanted part).
Needs numpy and gguf (the test extra). No root. Run it on a quiet machine: these disks vary a lot.
"""
import os, sys, time, mmap, threading, numpy as np
import gguf
MIB=2**20; A=4096
if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    sys.exit(__doc__)
model=sys.argv[1]; frac=float(sys.argv[2]) if len(sys.argv)>2 else 0.87
r=gguf.GGUFReader(model)
layers={}
for t in r.tensors:
    if t.name.endswith("_exps.weight"):
        L=int(t.name.split(".")[1]); ne=int(t.shape[-1]); per=int(t.n_bytes)//ne
        layers.setdefault(L,[]).append((int(t.data_offset),per,ne))
fdd=os.open(model,os.O_RDONLY|os.O_DIRECT); fdb=os.open(model,os.O_RDONLY)
size=os.fstat(fdb).st_size
def jobs_for(rng):
    out=[]
    for L in sorted(layers):
        ts=layers[L]; ne=ts[0][2]
        want=sorted(rng.choice(ne,size=int(round(frac*ne)),replace=False))
        out.append([(off+e*per,per) for e in want for (off,per,_) in ts])
    return out
def runs_of(step):
    """The tier's read jobs (llama_moe_stream::read_jobs): per projection tensor, runs of consecutive
    wanted experts, cut at ~8 MiB."""
    out=[]
    for off,n in sorted(step):
        if out and out[-1][0]+out[-1][1]==off and out[-1][1]+n<=max(8*MIB,n):
            out[-1]=(out[-1][0],out[-1][1]+n)
        else:
            out.append((off,n))
    return out
def run(mode, steps, lanes=4):
    os.posix_fadvise(fdb,0,size,os.POSIX_FADV_DONTNEED)
    tot=[0]
    if mode in ("runsd","runsb","runsb4"):  # the tier's runs: O_DIRECT on 4 lanes (today), buffered on 1 or 4
        steps=[runs_of(st) for st in steps]
        lanes=1 if mode=="runsb" else 4
        if mode=="runsb4":
            mode="runsb"
        elif mode=="runsd":
            mode="direct"
    if mode in ("seqd","seqd4"):  # O_DIRECT, aligned 8 MiB windows covering each layer's expert tensors
        steps=[]
        for L in sorted(layers):
            st=[]
            for (off,per,ne) in layers[L]:
                w0=off&~(A-1); w1=(off+per*ne+A-1)&~(A-1)
                st+=[(o,min(8*MIB,w1-o)) for o in range(w0,w1,8*MIB)]
            steps.append(st)
        lanes=1 if mode=="seqd" else 4
    if mode=="seq":  # the whole of each layer's expert tensors, one lane, in 8 MiB reads (what readahead gets)
        steps=[[(off, per*ne) for (off,per,ne) in layers[L]] for L in sorted(layers)]
        lanes=1
    maxper=max(min(p, 8*MIB) for st in steps for _,p in st)+2*A  # the largest window one read takes
    def lane(q,lock,buf):
        mv=memoryview(buf)
        while True:
            with lock:
                if not q: break
                off,n=q.pop()
            if mode=="runsb":
                got=0
                for o in range(off, off+n, 8*MIB):
                    k=min(8*MIB, off+n-o); got+=os.preadv(fdb,[mv[:k]],o)
                os.posix_fadvise(fdb,off,n,os.POSIX_FADV_DONTNEED)
            elif mode in ("seqd","seqd4"):
                got=os.preadv(fdd,[mv[:n]],off)
            elif mode=="seq":
                got=0
                for o in range(off, off+n, 8*MIB):
                    k=min(8*MIB, off+n-o); got+=os.preadv(fdb,[mv[:k]],o)
                os.posix_fadvise(fdb,off,n,os.POSIX_FADV_DONTNEED)
            elif mode=="direct":
                w0=off&~(A-1); w1=(off+n+A-1)&~(A-1)
                got=os.preadv(fdd,[mv[:w1-w0]],w0)
            else:
                got=os.preadv(fdb,[mv[:n]],off)
                os.posix_fadvise(fdb,off,n,os.POSIX_FADV_DONTNEED)
            tot[0]+=got
        mv.release()
    t0=time.perf_counter()
    bufs=[mmap.mmap(-1,maxper) for _ in range(lanes)]
    for st in steps:  # one layer step at a time, as the tier does
        q=list(reversed(st)); lock=threading.Lock()
        th=[threading.Thread(target=lane,args=(q,lock,bufs[i])) for i in range(lanes)]
        [t.start() for t in th]; [t.join() for t in th]
    dt=time.perf_counter()-t0
    return tot[0]/MIB/dt
rng=np.random.default_rng(0)
res={"direct":[],"runsd":[],"runsb":[],"runsb4":[],"seq":[],"seqd4":[]}
for rep in range(3):
    steps=jobs_for(rng)
    order=list(res)
    for m in (order if rep%2==0 else order[::-1]):
        res[m].append(run(m,steps))
for m,v in res.items(): print(f"{m:9s} median {np.median(v):6.0f} MiB/s {[round(x) for x in v]}")
