"""Paper roofline of the two NKI kernels on one trn2 NeuronCore, at the tiny and the real V4.1-Flash shapes.

    python -m dsneuron.kernels_nki.roofline

The work model counts exactly the instructions `sparse_attn_nki` and `mqa_logits_nki` issue (the
suite checks it against the stand-in's counters), in the stand-in's units: Tensor Engine columns
(moving columns streamed; fp32 operands take 4 passes), per-partition elements of each ScalarE,
VectorE and GpSimd instruction, and DMA bytes. Time per engine = work / rate, plus a fixed cost per
instruction; the largest is the bound. Nothing here was measured: no trn2 was available.

trn2 figures per NeuronCore-v3 (aws-neuron/aws-neuron-sdk@81ce03a):
  - Tensor Engine 2.4 GHz, 79 bf16 / 158 fp8 / 20 fp32 dense TFLOPS
    (nki/guides/architecture/trainium2_arch.rst, engine table and l.71): one 128x128 column per cycle;
  - Vector Engine 0.96 GHz, 256 elements per cycle (512 for bf16 in and out), Scalar Engine 1.2 GHz,
    128 elements per cycle (same table): 2 and 1 elements per partition per cycle;
  - GpSimd 1.2 GHz, eight cores; its elementwise rate is not documented: ASSUMED 1 element per
    partition per cycle;
  - HBM 2.9 TB/s per chip of 8 NeuronCores (about-neuron/arch/neuron-hardware/trainium2.rst), a
    362.5 GB/s share per core; 16 DMA engines of 23 B/ns per core and ~1300 ns fixed cost per DMA
    (nki/deep-dives/nki-dma-bandwidth-guide.rst), which also says rows under 256 B per partition run
    far below peak bandwidth;
  - fixed costs: ~64 Tensor Engine cycles per matmul (MM_INIT_LATENCY, trn1 figure) and ~100 cycles
    per ScalarE/VectorE/GpSimd instruction (nki/deep-dives/nki_perf_guide.rst, l.417 and l.679).
"""

from __future__ import annotations

from dataclasses import dataclass, field

P_MAX, BLOCK, KEY_TILE, SCALE_BLOCK = 128, 64, 512, 32


@dataclass
class EngineWork:
    """Instructions on one engine and the sum of their per-partition element counts."""

    instructions: int = 0
    elements: int = 0

    def add(self, elements: int, times: int = 1) -> None:
        self.instructions += times
        self.elements += int(elements) * times


@dataclass
class Work:
    """Instruction-stream totals of one kernel call (field meanings: sim.machine.Stats)."""

    pe_instructions: int = 0
    pe_columns: int = 0
    pe_flops: int = 0
    act: EngineWork = field(default_factory=EngineWork)
    dve: EngineWork = field(default_factory=EngineWork)
    pool: EngineWork = field(default_factory=EngineWork)
    dma_transfers: int = 0
    hbm_read: int = 0
    hbm_write: int = 0

    def pe(self, columns: int, flops: int = 0, times: int = 1, fp32: bool = False) -> None:
        self.pe_instructions += times
        self.pe_columns += columns * times * (4 if fp32 else 1)
        self.pe_flops += flops * times

    def dma(self, read: int = 0, write: int = 0, times: int = 1) -> None:
        self.dma_transfers += times
        self.hbm_read += read * times
        self.hbm_write += write * times


# ------------------------------------------------------------------------------- sparse attention
def sparse_attn_work(batch: int, seqlen: int, heads: int, dim: int, topk: int, valid_slots: int | None = None) -> Work:
    """Work of sparse_attn_kernel for q [B,S,H,D], idx [B,S,K] (K a multiple of 64, D of 128).

    valid_slots: in-range indices over the whole call (the gathers move only those rows); None = all.
    """
    tokens, blocks, chunks = batch * seqlen, topk // BLOCK, dim // P_MAX
    valid = tokens * topk if valid_slots is None else valid_slots
    w = Work()
    w.dve.add(heads)  # ones
    w.dma(read=heads * 4)  # sink
    for _ in range(tokens):
        w.dma(read=heads * dim * 2)  # q row
        w.pe(heads, times=chunks)  # q transposes
        w.act.add(heads, chunks)
        w.dma(read=topk * 4, times=2)  # index columns and row
        w.dve.add(blocks, 4)  # validity, gather rows
        w.dve.add(topk, 3)  # empty-slot offsets
        w.dve.add(1, 2)  # running max and sum
        w.dve.add(dim)  # O = 0
        for _ in range(blocks):
            w.pool.add(dim)  # zero the gather tile
            w.dma_transfers += 1
            w.pe(BLOCK, times=chunks)  # KV transposes
            w.act.add(BLOCK, chunks)
            w.pe(BLOCK, 2 * P_MAX * heads * BLOCK, times=chunks)  # QK^T
            w.pe(BLOCK, 2 * heads * BLOCK)  # empty-slot offsets
            w.dve.add(BLOCK)  # block max
            w.dve.add(1)  # new max
            w.act.add(1)  # alpha
            w.act.add(BLOCK)  # P = exp, row sum
            w.dve.add(1)  # l
            w.pe(heads)  # P^T
            w.dve.add(heads)
            w.pe(dim, 2 * BLOCK * heads * dim)  # P @ V
            w.dve.add(dim)  # O = O * alpha + PV
        w.act.add(1)  # exp(sink - m)
        w.dve.add(1, 4)  # total, empty, select, reciprocal
        w.dve.add(dim)  # O / total
        w.dma(write=heads * dim * 2)
    w.hbm_read += valid * dim * 2
    return w


# ------------------------------------------------------------------------------------ MQA logits
def _dequant_work(w: Work, dim: int, fmt: str) -> None:
    groups = dim // SCALE_BLOCK
    if fmt == "fp4":
        w.dve.add(dim // 2)  # widen bytes
        w.dve.add(dim // 2, 2 * 8)  # per nibble plane: 8 vector instructions
        w.pool.add(dim // 2, 2)  # ... and the sign merge
    else:
        w.dve.add(dim)
    w.dve.add(dim, 7)  # e4m3fn decode
    w.pool.add(dim)
    w.dve.add(groups, 5)  # UE8M0 decode
    w.pool.add(groups, 2)
    w.dve.add(dim)  # times the scale


def mqa_logits_work(rows: int, heads: int, dim: int, fmt: str, cols: int, block_size: int = 0,
                    weights_bf16: bool = False, valid_keys: int | None = None) -> Work:
    """Work of mqa_logits_kernel (block_size 0) or mqa_logits_sparse_kernel for S rows, H heads,
    head dim D, `cols` output columns per row (L, or NB*B). valid_keys: gathered in-range keys over
    the whole call; None = all."""
    width = dim // 2 if fmt == "fp4" else dim
    groups, chunks = dim // SCALE_BLOCK, -(-dim // P_MAX)
    valid = rows * cols if valid_keys is None else valid_keys
    w = Work()
    for _ in range(rows):
        w.dma(read=heads * width)
        w.dma(read=heads * groups)
        _dequant_work(w, dim, fmt)
        w.pe(heads, times=chunks)  # q transposes
        w.act.add(heads, chunks)
        w.dma(read=heads * (2 if weights_bf16 else 4))
        if weights_bf16:
            w.dve.add(1)
        w.dma(read=P_MAX * 4, times=2)  # ks, ke broadcasts
        w.dve.add(1, 2 if block_size == 0 else 4)
        for t0 in range(0, cols, KEY_TILE):
            n = min(KEY_TILE, cols - t0)
            for u0 in range(0, n, P_MAX):
                nu = min(P_MAX, n - u0)
                if block_size == 0:
                    w.pool.add(1)  # iota
                    w.dve.add(1, 4)
                else:
                    w.pool.add(1, 2)
                    w.dma(read=nu * 4)
                    w.dve.add(1, 9)
                w.pool.add(width)
                w.pool.add(groups)
                w.dma_transfers += 2
                _dequant_work(w, dim, fmt)
                w.pe(nu, times=chunks)  # key transposes
                w.act.add(nu, chunks)
                w.pe(nu, fp32=True)  # validity transpose
                w.dve.add(nu)
            for c in range(chunks):
                w.pe(n, 2 * min(P_MAX, dim - c * P_MAX) * heads * n)
            w.act.add(n)  # relu
            w.pe(n, 2 * heads * n, fp32=True)  # weighted head sum
            w.dve.add(n, 3)  # to bf16, empty mask, select
            w.dma(write=n * 2)
    w.hbm_read += valid * (width + groups)
    return w


# --------------------------------------------------------------------------------------- roofline
@dataclass(frozen=True)
class Trn2Core:
    """Peak rates of one NeuronCore-v3 (module docstring gives the sources)."""

    pe_hz: float = 2.4e9
    dve_hz: float = 0.96e9
    dve_per_cycle: float = 2.0
    act_hz: float = 1.2e9
    pool_hz: float = 1.2e9
    hbm_bytes_per_s: float = 2.9e12 / 8
    pe_fixed_cycles: int = 64
    engine_fixed_cycles: int = 100
    dma_fixed_s: float = 1.3e-6
    dma_engines: int = 16
    bf16_flops: float = 79e12


@dataclass(frozen=True)
class Estimate:
    """Seconds per engine: streaming only, and with the fixed per-instruction costs added."""

    stream: dict
    fixed: dict

    def bound(self, with_fixed: bool = True) -> tuple[str, float]:
        times = self.fixed if with_fixed else self.stream
        name = max(times, key=times.get)
        return name, times[name]


def estimate(w: Work, core: Trn2Core = Trn2Core()) -> Estimate:
    """Per-engine time of a Work on one trn2 NeuronCore, assuming perfect overlap between engines."""
    stream = {
        "PE": w.pe_columns / core.pe_hz,
        "ACT": w.act.elements / core.act_hz,
        "DVE": w.dve.elements / (core.dve_per_cycle * core.dve_hz),
        "POOL": w.pool.elements / core.pool_hz,
        "HBM": (w.hbm_read + w.hbm_write) / core.hbm_bytes_per_s,
    }
    fixed = {
        "PE": stream["PE"] + w.pe_instructions * core.pe_fixed_cycles / core.pe_hz,
        "ACT": stream["ACT"] + w.act.instructions * core.engine_fixed_cycles / core.act_hz,
        "DVE": stream["DVE"] + w.dve.instructions * core.engine_fixed_cycles / core.dve_hz,
        "POOL": stream["POOL"] + w.pool.instructions * core.engine_fixed_cycles / core.pool_hz,
        "HBM": stream["HBM"] + w.dma_transfers * core.dma_fixed_s / core.dma_engines,
    }
    return Estimate(stream, fixed)


#: (kernel, shape name, work function, kwargs, useful flops). Tiny: configs/tiny.json at the
#: bench.ops shapes; real: V4.1-Flash (docs/architecture.md "Tokenizer and configs"): 64 heads of 512,
#: window 128 + index top-k 512; indexer 32 heads of 128 over ratio-2 compressed keys; candidate
#: path 2048 blocks of 8. Prefill 4096 tokens (ks = 0, causal), decode one token at 64K context.
def _cases():
    def attn(name, s, h, k):
        return ("sparse_attn", name, sparse_attn_work, dict(batch=1, seqlen=s, heads=h, dim=512, topk=k),
                4 * s * h * k * 512)

    def mqa(name, s, h, cols, block_size=0):
        kernel = "mqa_logits_sparse" if block_size else "mqa_logits"
        return (kernel, name, mqa_logits_work, dict(rows=s, heads=h, dim=128, fmt="fp4", cols=cols,
                                                    block_size=block_size), 2 * s * h * 128 * cols + 2 * s * h * cols)

    return [
        attn("tiny prefill S=715 H=8 K=192", 715, 8, 192),
        attn("tiny decode S=1 H=8 K=192", 1, 8, 192),
        attn("V4.1 prefill S=4096 H=64 K=640", 4096, 64, 640),
        attn("V4.1 decode S=1 H=64 K=640", 1, 64, 640),
        mqa("tiny prefill S=715 H=4 L=357", 715, 4, 357),
        mqa("tiny decode S=1 H=4 L=512", 1, 4, 512),
        mqa("V4.1 prefill S=4096 H=32 L=2048", 4096, 32, 2048),
        mqa("V4.1 decode S=1 H=32 L=32768", 1, 32, 32768),
        mqa("tiny prefill S=715 H=4 32x8", 715, 4, 256, 8),
        mqa("V4.1 decode S=1 H=32 2048x8", 1, 32, 16384, 8),
    ]


NOTES = {
    "sparse_attn": (
        "QK^T and P@V use H of the 128 PE columns (H=8: 6%, H=64: 50%) and K/V must be PE-transposed per "
        "64-key block, which costs as many PE columns as QK^T itself; a DMA transpose of the gathered "
        "rows would free the PE.",
        "One token per step: no KV reuse between query tokens, and per-token [H,1] bookkeeping pays the "
        "~100-cycle fixed cost many times over; at LNC=2 (trn2's default) the second core idles.",
        "One PSUM tile per role serialises consecutive blocks; double-buffering by block parity "
        "(8 banks suffice) lets the PE run ahead of ScalarE/VectorE.",
        "The token loop is unrolled at trace time: instruction count grows with S*K/64 (a runtime loop "
        "needs nl.fori_loop, nki >= 0.6).",
    ),
    "mqa_logits": (
        "Decoding keys on VectorE dominates (about 9 passes over each element for FP8, 17 for FP4, "
        "plus ~100-cycle fixed costs on [128, 1] index tiles): every query row re-decodes its keys, so "
        "dense prefill repeats the work S times; a tokens-on-partitions layout sharing decoded key "
        "tiles would remove that factor (the sparse op cannot share: each row has its own blocks).",
        "Gathered key rows are 64-128 B, far below the 2 KiB per partition the DMA guide asks for, so "
        "the HBM figure is optimistic; for the dense op one contiguous load per tile would do.",
        "No FP8 on the PE: DeepSeek's e4m3fn (max 448) is not trn2's fp8 (max 240), and per-32 scales "
        "need MX matmuls (trn3); the bf16 PE rate is not the limit anyway.",
        "The weighted head sum is an fp32 matmul (4 PE passes) on one output partition.",
    ),
}


def rows(core: Trn2Core = Trn2Core()) -> list[dict]:
    """One dict per (kernel, shape): work, per-engine microseconds and the bound."""
    out = []
    for kernel, name, fn, kwargs, flops in _cases():
        w = fn(**kwargs)
        est = estimate(w, core)
        bound, seconds = est.bound()
        out.append({
            "kernel": kernel, "shape": name, "work": w, "estimate": est, "bound": bound, "seconds": seconds,
            "useful_flops": flops, "pe_util": flops / seconds / core.bf16_flops,
        })
    return out


def main() -> None:
    """Print the roofline table and the notes."""
    head = f"{'kernel':<18} {'shape':<34} {'PE':>9} {'ACT':>9} {'DVE':>9} {'POOL':>9} {'HBM':>9} {'bound':>6} {'bf16 util':>9}"
    print("trn2, one NeuronCore-v3; microseconds per engine with fixed costs (streaming only in brackets)")
    print(head)
    print("-" * len(head))
    for r in rows():
        est = r["estimate"]
        cells = " ".join(f"{est.fixed[k] * 1e6:>9.1f}" for k in ("PE", "ACT", "DVE", "POOL", "HBM"))
        print(f"{r['kernel']:<18} {r['shape']:<34} {cells} {r['bound']:>6} {r['pe_util']:>8.1%}")
        streams = " ".join(f"{'(' + format(est.stream[k] * 1e6, '.1f') + ')':>9}" for k in ("PE", "ACT", "DVE", "POOL", "HBM"))
        print(f"{'':<18} {'':<34} {streams}")
    print()
    for kernel, notes in NOTES.items():
        print(f"{kernel}: where the design leaves performance on the table")
        for note in notes:
            print(f"  - {note}")


if __name__ == "__main__":
    main()
