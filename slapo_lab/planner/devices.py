"""What one accelerator and its links can do: :class:`DeviceProfile`, the built-in profiles, and :func:`calibrate`.

A profile holds the figures the planner's cost model divides by (``slapo_lab/planner/model.py``): dense
matmul FLOP/s, memory size and bandwidth, and the bandwidth and latency of the links inside a node and between
nodes. Built-in profiles carry datasheet figures; :func:`calibrate` measures the machine it runs on (matmul
FLOP/s by size with ``torch.matmul``, a memory copy, and gloo collectives between two local processes), and a
plan can use that measured profile instead.

Units: FLOP/s, bytes, bytes per second (one direction, per GPU), seconds.

Sources of the built-in figures (vendor datasheets, by name; the peak FLOP/s are read from
:data:`slapo_lab.hardware.PEAK_TFLOPS`, the table the training runtime's MFU uses too):

* NVIDIA A100 40GB / 80GB SXM: "NVIDIA A100 Tensor Core GPU" datasheet (2021): BF16 312 TFLOPS dense, FP32
  19.5 TFLOPS, HBM2 1,555 GB/s (40GB) and HBM2e 2,039 GB/s (80GB); NVLink 3: 600 GB/s per GPU both directions
  together (300 GB/s each way). Inter-node: DGX A100 user guide, 8 x 200 Gb/s HDR InfiniBand (ConnectX-6), one
  per GPU: 25 GB/s each way.
* NVIDIA H100 SXM5 / PCIe: "NVIDIA H100 Tensor Core GPU" datasheet (2023): BF16 989 (SXM) / 756 (PCIe) TFLOPS
  dense (half the with-sparsity figures), FP32 67 / 51 TFLOPS, HBM3 3.35 TB/s (SXM), HBM2e 2.0 TB/s (PCIe),
  80 GB; NVLink 4: 900 GB/s per GPU both ways (SXM); PCIe Gen5 x16: 128 GB/s both ways (PCIe card, no
  NVSwitch). Inter-node: DGX H100 user guide, 8 x 400 Gb/s NDR InfiniBand (ConnectX-7), one per GPU: 50 GB/s.
* NVIDIA H200 SXM: "NVIDIA H200 Tensor Core GPU" datasheet (2024): compute as H100 SXM (989 / 67 TFLOPS),
  141 GB HBM3e at 4.8 TB/s, NVLink 4 (900 GB/s both ways); NDR 400 Gb/s per GPU as DGX H200.
* NVIDIA B200: "NVIDIA DGX B200" datasheet (2024): 72 PFLOPS FP8 training per 8 GPUs with sparsity, i.e. 4.5
  PFLOPS FP8 dense per GPU and 2.25 PFLOPS BF16 dense; 1,440 GB HBM3e per 8 GPUs (180 GB each) at 64 TB/s (8 TB/s
  each); NVLink 5: 1.8 TB/s per GPU both ways; 8 x 400 Gb/s ConnectX-7 (50 GB/s per GPU). FP32 80 TFLOPS is the
  HGX B200 figure for FP32 (assumed; NVIDIA lists it for HGX, not per GPU in the DGX sheet).
* AMD Instinct MI300X: "AMD Instinct MI300X Accelerator" datasheet (2023): BF16 1,307.4 TFLOPS dense, FP32
  163.4 TFLOPS, 192 GB HBM3 at 5.3 TB/s; 7 Infinity Fabric links of 128 GB/s both ways (448 GB/s per GPU each
  way to its 7 peers); 400 Gb/s per GPU between nodes (50 GB/s).

``matmul_efficiency``: the fraction of the datasheet BF16 peak that a large, well-shaped ``matmul`` reaches,
measured with ``mamf-finder.py`` (Stas Bekman, ``ml-engineering``, ``compute/accelerator/README.md``, table
"Maximum Achievable Matmul FLOPS comparison table"): A100 SXM 85.9 %, A100 PCIe 82.2 %, H100 SXM 80.1 %,
MI300X 60.1 %. H100 PCIe, H200 and B200 are not in that table: they take the H100 SXM value (the same Hopper /
similar tensor-core generation; an assumption, said here). ``memory_efficiency`` (0.9) is the fraction of the
datasheet HBM bandwidth a large copy reaches (an assumption of the usual order of a STREAM-like copy; not
measured here). Link latencies are per collective step: 10 us inside a node and 20 us between nodes, orders of
magnitude of NCCL's small-message times (nccl-tests), also an assumption. None of these constants is fitted to a
training run.

What the cost model needs beyond the datasheet, and the built-in GPU values of it:

* ``op_overhead``: host seconds to dispatch one aten op in eager mode. GPU profiles: 4 us, the order of a CUDA
  kernel launch from PyTorch ("a few microseconds", PyTorch blog "Accelerating PyTorch with CUDA Graphs", 2021;
  an assumption; :func:`calibrate` measures it, host-side, for a tiny CUDA op). ``launch_async`` (True on GPUs:
  the host queues kernels ahead of the device) makes an op cost ``max(kernel, overhead)``; on a CPU (False) the
  host runs the kernel itself, so an op costs ``kernel + overhead``.
* ``memory_curve``: achieved bytes/s by an op's working set, ``((bytes, bytes/s), ...)`` ascending; an op
  moving ``n`` bytes gets the bandwidth interpolated at ``log n`` (caches make small working sets faster;
  beyond the last point the memory bandwidth holds). GPU profiles: empty (every op priced at HBM bandwidth,
  the conservative default: an H100's 50 MB L2 is left out).
* ``comm_overlap``: the fraction of a data-parallel collective that runs under compute. GPU profiles: 1.0 (NCCL
  runs on its own CUDA stream while backward computes: Li et al., 2020, "PyTorch Distributed: Experiences on
  Accelerating Data Parallel Training", VLDB, section 3.2.3). On a CPU :func:`calibrate` measures it (gloo's
  all-reduce issued asynchronously while the same process multiplies matrices).
* ``attention_efficiency``: the fraction of the datasheet peak a fused attention kernel (``scaled_dot_product_
  attention``'s flash backend, FlashAttention-2) reaches, forward and backward together; attention is priced at
  it, not at ``matmul_efficiency``. Hopper (H100, H200): 0.35, "FlashAttention-2 achieves only 35% utilization
  on H100" (Shah et al., 2024, "FlashAttention-3", abstract). A100: 0.50, the low end of "50-73% of the
  theoretical maximum FLOPs/s on A100" (Dao, 2023, "FlashAttention-2", abstract; the backward pass is the slower
  one). B200 and MI300X: 0.35, the Hopper figure (an assumption: no published FlashAttention-2 figure for them
  was found). :func:`calibrate` measures it (a causal SDPA forward + backward).
* ``matmul_curve``: achieved matmul FLOP/s by size, ``((FLOPs of one matmul, fraction of the dtype's peak),
  ...)`` ascending; a matmul of ``f`` FLOPs gets the fraction interpolated at ``log f`` (small matmuls do not
  fill the machine), the last point's beyond it. GPU profiles: empty (every matmul at ``matmul_efficiency``).
  :func:`calibrate` measures it with square matmuls of 64 to 2048 (4096) in the device's training dtype (fp32
  on a CPU, bf16 on a GPU), each as a fraction of the best.
* ``collective_scale``: how much slower than a ring the backend's all-gather and reduce-scatter run. GPU
  profiles: empty (1: NCCL runs them as rings, the model of nccl-tests' ``doc/PERFORMANCE.md``). gloo on a CPU
  builds them from other collectives and :func:`calibrate` measures it (2026-11-27, 2 ranks, 32 MiB: all-reduce
  94 ms, all-gather 161 ms, reduce-scatter 165 ms, where a ring takes half the all-reduce).
* ``optimizer_curve``: seconds per element of the training runtime's optimizer step (``torch.optim.AdamW`` with
  its defaults) by parameter-tensor size, ``((elements per tensor, seconds per element), ...)`` ascending; a
  tensor of ``n`` elements gets the figure interpolated at ``log n``. GPU profiles: empty (the step is priced
  from AdamW's own op sequence at HBM bandwidth, :func:`slapo_lab.planner.pricer.adam_op_costs`).
  :func:`calibrate` measures it (:func:`optimizer_rates`): on a CPU the step is not priced well by the copy
  curve -- this project's 2-core CPU steps a 64 Ki-element tensor at 3.3 ns per element and a 16 Mi-element
  one at 8.1, where AdamW's op sequence at the copy curve's bandwidth said 1.8 and 20.6.
* ``fresh_page_cost``: seconds per byte a host pays, beyond the write itself, the first time it writes memory the
  allocator has just mapped -- the kernel's page faults. On a CPU, PyTorch allocates through glibc ``malloc``,
  which maps every block of ``fresh_page_bytes`` or more afresh and unmaps it when freed (glibc
  ``malloc/malloc.c``: ``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB on a 64-bit host, the ceiling of its dynamic mmap
  threshold), so each such output faults in all its pages again. A matmul is priced by its FLOPs, so it pays
  them on top (this project's 2-core CPU: a 62.5 MiB weight gradient, 32000 x 128 @ 128 x 512, takes 31 ms
  into a reused output and 55 ms into a fresh one; a fill of the same bytes 9 ms and 34 ms). A memory-bound op
  is priced at the ``memory_curve``, whose ``clone`` writes a fresh output too: it has them already. GPU
  profiles: 0 (PyTorch's CUDA caching allocator reuses its blocks). :func:`calibrate` measures it
  (:func:`first_touch_cost`).
* ``selective_op_overhead``: host seconds that torch's selective activation checkpointing adds to every op of a
  checkpointed block's forward and of its recomputation, the saved ones too:
  ``create_selective_checkpoint_contexts`` runs a Python ``TorchDispatchMode`` (``torch/utils/checkpoint.py``,
  ``_CachingTorchDispatchMode`` and ``_CachedTorchDispatchMode``) that calls the policy and keeps or fetches the
  op's output, in eager mode. Built-in profiles: 10 us, measured on this project's CPU host with torch 2.13 (a
  loop of tiny ``torch.add`` inside the mode against outside it, :func:`selective_op_overhead`: 9-15 us more per
  op, 2026-11-28), the same Python on any host (an assumption: a GPU host's CPU is of the same order; the lent
  H200's host measured 19 us). It is why selective checkpointing runs slower than full recomputation in eager
  mode where kernels are short: a 1.1 B Llama, batch 4 x 2048, bf16, on an H200 took 1.48x the forward +
  backward without checkpointing under it and 1.26x under full recomputation (``torch.utils.checkpoint``;
  2026-11-28, torch 2.11, ``benchmarks/checkpoint_overhead.py``), on about the same kernels. :func:`calibrate`
  measures it.
* Collectives are timed as a stream: the mean of back-to-back calls (:func:`_stream`), as a training step
  issues them. On two gloo processes sharing two cores, a 256 KiB all-reduce takes 0.22 ms at its fastest and
  1.2 ms on average (the waiting rank's wake-up), and a step pays the average. The waits are heavy-tailed (up to
  5 ms), so each size is a stream of 100 calls: with 20, four calibrations fitted latencies of 174-470 us, with
  100 285-354 us.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from ..hardware import peak_tflops_for

__all__ = ["DEVICES", "DeviceProfile", "calibrate", "device_profile"]

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceProfile:
    """What one accelerator and its links can do (units: FLOP/s, bytes, bytes/s one way per GPU, seconds).

    Attributes:
        name: the profile's name (``"H100-SXM"``, ``"calibrated cpu"``).
        bf16_flops / fp32_flops: dense peak FLOP/s of a matmul in that dtype.
        hbm_bytes: device memory (bytes).
        hbm_bandwidth: device memory bandwidth (bytes/s).
        intra_bandwidth / intra_latency: one GPU's link to its peers inside a node (NVLink, Infinity Fabric,
            PCIe), bytes/s each way, and seconds per collective step.
        inter_bandwidth / inter_latency: one GPU's share of the network between nodes (InfiniBand NIC).
        matmul_efficiency: achieved / peak FLOP/s for a large matmul (see the module docstring for sources).
        memory_efficiency: achieved / peak bytes/s for memory-bound kernels.
        source: where the figures come from, in words.
        op_overhead: host seconds per dispatched aten op (eager mode).
        launch_async: True where the host queues kernels ahead of the device (GPUs): an op costs
            ``max(kernel, op_overhead)``; False (a CPU): ``kernel + op_overhead``.
        memory_curve: ``((working-set bytes, achieved bytes/s), ...)`` ascending, measured by :func:`calibrate`
            on a CPU; empty: ``hbm_bandwidth x memory_efficiency`` for every size.
        comm_overlap: the fraction (0..1) of a data-parallel collective that overlaps compute on this backend.
        collective_scale: ``(("all_gather", x), ("reduce_scatter", y))``: measured time over the ring model's for
            those collectives on this backend (empty: 1, a native ring).
        attention_efficiency: achieved / peak FLOP/s of a fused attention kernel, forward and backward (None:
            priced as a matmul of its FLOPs).
        matmul_curve: ``((FLOPs of one matmul, fraction of peak), ...)`` ascending (empty: ``matmul_efficiency``
            for every size).
        optimizer_curve: ``((elements per tensor, seconds per element), ...)`` ascending, the optimizer step
            measured by :func:`calibrate` (empty: priced from AdamW's op sequence).
        fresh_page_cost: seconds per byte of first writes to memory freshly mapped for an op's output of
            ``fresh_page_bytes`` or more, paid by FLOP-bound ops (0: none; module docstring).
        fresh_page_bytes: the smallest output the host's allocator maps afresh (bytes).
        selective_op_overhead: host seconds added to every op dispatched under torch's selective-checkpoint
            mode (a selectively checkpointed block's forward and its recomputation; module docstring).
        (Built-in values and their sources: the module docstring.)
    """

    name: str
    bf16_flops: float
    fp32_flops: float
    hbm_bytes: int
    hbm_bandwidth: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    matmul_efficiency: float = 0.8
    memory_efficiency: float = 0.9
    source: str = ""
    op_overhead: float = 4e-6
    launch_async: bool = True
    memory_curve: tuple = ()
    comm_overlap: float = 1.0
    collective_scale: tuple = ()
    attention_efficiency: float | None = None
    matmul_curve: tuple = ()
    optimizer_curve: tuple = ()
    fresh_page_cost: float = 0.0
    fresh_page_bytes: int = 32 << 20
    selective_op_overhead: float = 10e-6

    def __post_init__(self) -> None:
        # a profile read back from JSON (``DeviceProfile(**json.load(...))``) has lists: keep it hashable
        for name in ("memory_curve", "collective_scale", "matmul_curve", "optimizer_curve"):
            object.__setattr__(self, name, tuple(tuple(x) for x in getattr(self, name)))

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype`` (``"bf16"``, ``"fp16"`` use the bf16 figure; ``"fp32"`` the fp32 one)."""
        return self.fp32_flops if dtype == "fp32" else self.bf16_flops


def _nv(name, lookup, gb, bw, nvlink, ib, eff, attn, source):
    """A built-in profile; its peak FLOP/s are :data:`slapo_lab.hardware.PEAK_TFLOPS`' for the GPU ``lookup``.

    Raises:
        ValueError: ``lookup`` has no bf16 or fp32 figure in that table.
    """
    bf16, fp32 = peak_tflops_for(lookup, "bf16"), peak_tflops_for(lookup, "fp32")
    if bf16 is None or fp32 is None:
        raise ValueError(f"slapo_lab.hardware.PEAK_TFLOPS has no bf16 and fp32 figures for {lookup!r}.")
    return DeviceProfile(
        name=name,
        bf16_flops=bf16 * 1e12,
        fp32_flops=fp32 * 1e12,
        hbm_bytes=int(gb * GiB),
        hbm_bandwidth=bw * 1e12,
        intra_bandwidth=nvlink * 1e9,
        intra_latency=10e-6,
        inter_bandwidth=ib * 1e9,
        inter_latency=20e-6,
        matmul_efficiency=eff,
        attention_efficiency=attn,
        source=source,
    )


#: Built-in profiles by name (figures and sources in the module docstring). Memory sizes are the datasheets'
#: "GB" read as GiB, as ``nvidia-smi`` shows them (an 80 GB H100 reports about 80 GiB less what the driver keeps).
DEVICES: dict[str, DeviceProfile] = {
    "A100-40GB": _nv("A100-40GB", "A100", 40, 1.555, 300, 25, 0.859, 0.50, "NVIDIA A100 datasheet; DGX A100"),
    "A100-80GB": _nv("A100-80GB", "A100", 80, 2.039, 300, 25, 0.859, 0.50, "NVIDIA A100 datasheet; DGX A100"),
    "H100-SXM": _nv(
        "H100-SXM", "H100", 80, 3.35, 450, 50, 0.801, 0.35, "NVIDIA H100 datasheet (SXM5); DGX H100"
    ),
    "H100-PCIe": _nv("H100-PCIe", "H100 PCIe", 80, 2.0, 64, 50, 0.801, 0.35, "NVIDIA H100 datasheet (PCIe)"),
    "H200": _nv("H200", "H200", 141, 4.8, 450, 50, 0.801, 0.35, "NVIDIA H200 datasheet; DGX H200"),
    "B200": _nv("B200", "B200", 180, 8.0, 900, 50, 0.801, 0.35, "NVIDIA DGX B200 datasheet"),
    "MI300X": _nv("MI300X", "MI300X", 192, 5.3, 448, 50, 0.601, 0.35, "AMD Instinct MI300X datasheet"),
}
_ALIASES = {"H100": "H100-SXM", "H100-80GB": "H100-SXM", "H100-SXM5": "H100-SXM", "A100": "A100-80GB",
            "H200-141GB": "H200", "H200-SXM": "H200", "MI300": "MI300X"}  # fmt: skip


def device_profile(gpu) -> DeviceProfile:
    """The profile for ``gpu``: a :class:`DeviceProfile` as is, or a built-in name (case-insensitive; ``"H100"``
    and ``"H100-80GB"`` mean the SXM part).

    Raises:
        ValueError: an unknown name (one sentence listing the known ones).
    """
    if isinstance(gpu, DeviceProfile):
        return gpu
    if isinstance(gpu, str):
        want = gpu.strip().upper()
        for key in list(DEVICES) + list(_ALIASES):
            if key.upper() == want:
                return DEVICES[_ALIASES.get(key, key)]
    raise ValueError(
        f"Unknown GPU {gpu!r}; use a DeviceProfile (sl.calibrate()) or one of {', '.join(DEVICES)}."
    )


# --------------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------------
def _time(fn, repeats: int) -> float:
    """The fastest seconds of ``fn()`` over ``repeats`` runs after one warm-up: on a machine shared with other
    work, the least disturbed run is the one that shows what the hardware does."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


MATMUL_LOOP_S = 0.005
"""Seconds each timed run of :func:`matmul_flops` lasts at least (as many calls as that takes): a single small
call (a 256 x 256 fp32 matmul, 0.2 ms on this project's CPU) timed alone reads a neighbour's burst of memory
traffic whole, and the best of five such calls read 0.60-0.69 of the large sizes' rate at 128 and 256 in one
calibration of 2026-11-27 where the others read 0.84-1.00."""


def matmul_flops(sizes=(256, 512, 1024, 2048), dtype=None, device=None, repeats: int = 5) -> dict[int, float]:
    """Achieved FLOP/s of an ``n x n @ n x n`` ``torch.matmul`` (``2 n^3`` FLOPs) for each ``n`` in ``sizes``:
    the fastest of ``repeats`` runs, each a loop of calls lasting at least :data:`MATMUL_LOOP_S` (one call when a
    single call lasts that long), timed to the device's end."""

    dtype = dtype or torch.float32
    cuda = device is not None and str(device).startswith("cuda")
    out = {}
    for n in sizes:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)

        def once(a=a, b=b):
            torch.matmul(a, b)
            if cuda:
                torch.cuda.synchronize()

        calls = max(1, int(MATMUL_LOOP_S / max(_time(once, 1), 1e-9)))

        def run(a=a, b=b, calls=calls):
            for _ in range(calls):
                torch.matmul(a, b)
            if cuda:
                torch.cuda.synchronize()

        out[n] = 2 * n**3 * calls / _time(run, repeats)
    return out


def attention_flops(dtype=None, device=None, repeats: int = 3) -> float:
    """Achieved FLOP/s of a causal ``torch.nn.functional.scaled_dot_product_attention`` forward + backward.

    The shape is a mid-sized LLM's attention (batch 1, 8 heads of 64, 1,024 tokens on a CPU; batch 4, 16 heads of
    128, 2,048 tokens on a GPU). FLOPs are ``torch.utils.flop_counter``'s formulas (``sdpa_flop_count`` and
    ``sdpa_backward_flop_count``), halved for the causal mask as the planner's profile counts them (the kernel
    skips the masked blocks).
    """

    dtype = dtype or torch.float32
    cuda = device is not None and str(device).startswith("cuda")
    b, h, s, d = (4, 16, 2048, 128) if cuda else (1, 8, 1024, 64)
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))

    def run():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        if cuda:
            torch.cuda.synchronize()

    shape = (b, h, s, d)
    flops = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
    return flops / 2 / _time(run, repeats)


def optimizer_rates(
    sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 24), total: int = 1 << 26, device=None, repeats: int = 1
) -> dict[int, float]:
    """Seconds per element of ``torch.optim.AdamW``'s step (its defaults, as ``slapo_lab.train`` builds it: the
    single-tensor loop on a CPU, the multi-tensor kernels on CUDA) over fp32 parameters of ``n`` elements each,
    for each ``n`` in ``sizes``: ``total / n`` such tensors (at least one, at most 64: a small size's cost is the
    per-tensor dispatch, which 64 tensors show, and a CPU whose ranks oversubscribe its cores pays a scheduler
    slice per parallel op) with gradients, the fastest of ``repeats`` steps timed after the first (which makes
    the moments) and a warm-up.

    With the default ``total`` of 2^26 elements, the two largest sizes hold 1 GiB of parameters, gradients and
    moments, beyond the caches as a model's tensors are (their cost is bandwidth); the smaller sizes' 64 tensors
    hold 64 MiB or less, and their cost is mostly the per-tensor dispatch. Each size's tensors are freed before
    the next size allocates: while a process holds memory it no longer uses, AdamW's fresh ``sqrt`` output can
    reuse those pages (measured on this project's CPU: a 16 Mi-element tensor then steps at 4.5 ns per element
    and faults no page, where a training process faults 64 MiB of new pages per tensor each step and takes 7.5).

    Returns:
        ``{n: seconds per element}``.
    """

    cuda = device is not None and str(device).startswith("cuda")
    out = {}
    for n in sizes:
        params = [
            torch.nn.Parameter(torch.ones(n, device=device)) for _ in range(max(1, min(total // n, 64)))
        ]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.AdamW(params, lr=1e-4)
        opt.step()

        def step(opt=opt):
            opt.step()
            if cuda:
                torch.cuda.synchronize()

        out[n] = _time(step, repeats) / (n * len(params))
        del step, opt, params  # freed before the next size allocates, as a training process holds one model
    return out


def _stream(fn, calls: int, loops: int = 3) -> float:
    """Seconds per call of ``fn`` issued ``calls`` times back to back, the median over ``loops`` such streams
    (after one warm-up call): what a training step pays for a collective it issues among others -- between
    processes that share cores, the mean includes the waiting rank's wake-ups, which the fastest single call
    hides."""
    fn()
    per = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls)
    return sorted(per)[len(per) // 2]


def _paired(base, fn, calls: int, loops: int = 3) -> float:
    """Seconds per call that ``fn`` takes beyond ``base`` (``fn`` runs ``base`` and something more): in each of
    ``loops`` pairs, a stream of ``calls`` of ``base`` and one of ``fn`` timed back to back (after a barrier of
    the default group), the median of the pairs' differences. A pair meets one load: on a host whose neighbours
    take memory bandwidth in bursts, a difference of two streams timed seconds apart carries the bursts' noise
    whole (measured on this project's 2-core CPU, 2026-11-27, before the pairs: the fitted gloo bandwidth
    1.7-2.4 GB/s and the overlap 0.08-0.51 over six calibrations within an hour; after, four read 1.1-1.7 GB/s
    and 0.00-0.10)."""
    diffs = [with_fn - alone for alone, with_fn in _back_to_back((base, fn), calls, loops)]
    return sorted(diffs)[len(diffs) // 2]


def _back_to_back(fns, calls: int, loops: int) -> list[tuple[float, ...]]:
    """Per loop of ``loops``, the seconds per call of a stream of ``calls`` of each of ``fns``
    (:func:`_stream`), timed one after the other, each after a barrier of the default group (so that every rank
    times the same stream together)."""
    out = []
    for _ in range(loops):
        times = []
        for fn in fns:
            dist.barrier()
            times.append(_stream(fn, calls, loops=1))
        out.append(tuple(times))
    return out


OVERLAP_LOOPS = 5
"""How many back-to-back triples (compute alone, the all-reduce alone, both) :func:`collective_times` times for
``comm_overlap``; the median fraction is kept."""


COLLECTIVE_BURST_S = 0.002
"""Seconds of matmuls each rank runs before every timed collective call in :func:`collective_times`: a step
issues its collectives between compute, not back to back. A judgement constant, of the order of one layer's
compute between two tensor-parallel syncs at the sizes a CPU trains. What it changes, measured on this project's
2-core CPU with 2 gloo ranks (stream medians of 50 calls, 3 runs): a 1 KiB to 256 KiB all-reduce costs 0.4-1.2 ms
back to back, 1.0-1.4 ms after 1 ms of matmuls and 1.1-2.4 ms after 3 ms (the waiting rank's wake-up and the
ranks' skew); an 8 MiB one 7.6-8.6 ms in all three. On a GPU machine the links are still timed with gloo between
CPU processes, and the burst is CPU work as well."""


def _matmul_loop(seconds: float):
    """A callable multiplying 256 x 256 fp32 matrices for about ``seconds`` (count set on first call)."""

    a = torch.randn(256, 256)
    one = _time(lambda: a @ a, 5)
    n = max(1, int(seconds / max(one, 1e-7)))

    def run():
        for _ in range(n):
            a @ a

    return run


def host_rates(sizes=(256, 512, 1024, 2048), device=None, sync=None) -> dict:
    """What one process achieves on ``device`` (None: the CPU), as :func:`calibrate` records it.

    Returns:
        dict: ``"by_size"`` (matmul FLOP/s by ``n`` for ``n`` in 64, 128 and ``sizes``, in the device's training
        dtype: bf16 on CUDA, fp32 on a CPU), ``"other"`` (the other dtype's best matmul FLOP/s), ``"attention"``
        (:func:`attention_flops` in the training dtype), ``"copy"`` (bytes/s of a 256 MiB ``clone``),
        ``"curve"`` (a CPU's :func:`copy_bandwidth` at 256 KiB to 64 MiB; empty on CUDA), ``"overhead"``
        (:func:`op_overhead`, seconds per op), ``"selective"`` (:func:`selective_op_overhead`, seconds per op),
        ``"optimizer"`` (:func:`optimizer_rates`, seconds per element by tensor size) and ``"fresh"`` (a CPU's
        :func:`first_touch_cost`, seconds per byte; 0 on CUDA).

    ``sync``: called before each of those measurements (the gloo processes of :func:`collective_times` pass a
    barrier, so that every rank measures the same thing at the same time, as a step's ranks run the same ops).
    """
    cuda = device is not None and str(device).startswith("cuda")
    train_dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.empty(64 << 20, dtype=torch.float32, device=device)

    def clone():  # CUDA runs it asynchronously: time it to its end
        x.clone()
        if cuda:
            torch.cuda.synchronize()

    measure = {
        "by_size": lambda: matmul_flops((64, 128, *sizes), train_dtype, device),
        "other": lambda: max(matmul_flops(sizes, torch.float32 if cuda else torch.bfloat16, device).values()),
        "attention": lambda: attention_flops(train_dtype, device),
        "copy": lambda: 2 * x.numel() * 4 / _time(clone, 3),
        "curve": lambda: {} if cuda else copy_bandwidth([1 << k for k in range(18, 27, 2)]),
        "overhead": lambda: op_overhead(device),
        "selective": lambda: selective_op_overhead(device),
        "optimizer": lambda: optimizer_rates(device=device),
        "fresh": lambda: 0.0 if cuda else first_touch_cost(),
    }
    out = {}
    for key, fn in measure.items():
        if sync is not None:
            sync()
        out[key] = fn()
    return out


def _slowest(rates: list[dict]) -> dict:
    """Per figure, the slowest rank's: the least FLOP/s and bytes/s, the most seconds per op or element (a step
    waits for the slowest rank)."""
    first = rates[0]
    return {
        "by_size": {n: min(r["by_size"][n] for r in rates) for n in first["by_size"]},
        "other": min(r["other"] for r in rates),
        "attention": min(r["attention"] for r in rates),
        "copy": min(r["copy"] for r in rates),
        "curve": {n: min(r["curve"][n] for r in rates) for n in first["curve"]},
        "overhead": max(r["overhead"] for r in rates),
        "selective": max(r["selective"] for r in rates),
        "optimizer": {n: max(r["optimizer"][n] for r in rates) for n in first["optimizer"]},
        "fresh": max(r["fresh"] for r in rates),
    }


def _measure_links(rank: int, world: int, sizes, repeats: int, queue, host: tuple | None) -> None:
    """The measurements of one :func:`collective_times` process, in its initialised gloo group."""
    if host is not None:  # every rank measures at once, sharing the host as a run's ranks do
        dist.barrier()
        queue.put(("host", rank, host_rates(host, sync=dist.barrier)))
    # each call follows a burst of compute, as a step issues its collectives between layers' compute: the
    # collective's cost is the stream's time less the bursts' own, each pair timed back to back (_paired)
    burst = _matmul_loop(COLLECTIVE_BURST_S)

    def in_step(call):
        def run():
            burst()
            call()

        return max(_paired(burst, run, repeats), 1e-7)

    times = {}
    for n in sizes:
        t = torch.ones(n // 4, dtype=torch.float32)
        times[n] = in_step(lambda t=t: dist.all_reduce(t))
    # all-gather and reduce-scatter of the largest size (a backend may build them from other collectives)
    big = torch.ones(max(sizes) // 4, dtype=torch.float32)
    half = torch.ones(max(sizes) // 4 // world, dtype=torch.float32)
    # torch 2.13 names them *_single and deprecates the *_tensor names, which older releases (2.11) alone have
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    times["all_gather"] = in_step(lambda: gather(big, half))
    times["reduce_scatter"] = in_step(lambda: scatter(half, big))
    times["size"] = max(sizes)
    # overlap: an all-reduce of the largest size issued asynchronously while this process multiplies
    # matrices for about as long as the all-reduce alone takes; the three streams (compute alone, all-reduce
    # alone, both) timed back to back, OVERLAP_LOOPS times, and the median of each loop's fraction
    work = _matmul_loop(times[max(sizes)])

    def both():
        h = dist.all_reduce(big, async_op=True)
        work()
        h.wait()

    triples = _back_to_back((work, lambda: dist.all_reduce(big), both), min(20, repeats), OVERLAP_LOOPS)
    fractions = [
        (t_comp + t_comm - t_both) / max(min(t_comp, t_comm), 1e-9) for t_comp, t_comm, t_both in triples
    ]
    overlap = sorted(fractions)[len(fractions) // 2]
    if rank == 0:
        queue.put(("links", rank, (times, min(1.0, max(0.0, overlap)))))


def _collective_worker(
    rank: int, world: int, init: str, sizes, repeats: int, queue, threads: int = 1, host: tuple | None = None
) -> None:
    torch.set_num_threads(threads)  # as the ranks of a CPU run will have them
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        _measure_links(rank, world, sizes, repeats, queue, host)
    except Exception as err:  # any failure: the caller's sentence names it, then the process fails
        first = (str(err).splitlines() or [""])[0][:200]  # its first line: the caller says one sentence
        queue.put(("error", rank, f"{type(err).__name__}: {first}"))
        raise
    finally:
        dist.destroy_process_group()


def _exit_reason(code: int | None) -> str:
    """How a process ended, in words: ``"exit code 1"``, ``"signal SIGKILL"`` or ``"still running"``."""
    if code is None:
        return "still running"
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def collective_times(
    sizes=(1 << 10, 1 << 16, 1 << 20, 1 << 23), world: int = 2, repeats: int = 50, host: tuple | None = None
) -> tuple[dict[int, float], float, dict | None]:
    """Seconds (per call of a stream of ``repeats``, :func:`_stream`; each call after :data:`COLLECTIVE_BURST_S` of
    matmuls on every rank, whose own time, timed in a stream right before, is taken off: :func:`_paired`) of a gloo
    ``all_reduce`` of ``n`` bytes (fp32) between ``world`` local processes (``torch.multiprocessing`` spawn, a
    ``file://`` rendezvous in a temporary folder), for each ``n`` in ``sizes`` (and under the keys ``"all_gather"``
    / ``"reduce_scatter"`` those collectives' seconds at the largest size, ``"size"``), and the fraction of the
    largest all-reduce that overlaps a matmul loop when issued with ``async_op=True`` (0: none, 1: fully hidden):
    ``(t_compute + t_comm - t_both) / min(t_compute, t_comm)`` from three streams of 20 calls (at most ``repeats``)
    timed back to back, the median of :data:`OVERLAP_LOOPS` such triples, clipped to 0..1. The processes run on the
    caller's ``torch.get_num_threads()`` threads each. With ``host`` (the matmul ``sizes`` of :func:`host_rates`),
    every process first measures :func:`host_rates` at the same time, and the third item returned is the slowest
    rank's figures (:func:`_slowest`; None without ``host``).

    Raises:
        RuntimeError: a process failed, or had not finished within 600 s, before every figure was in; the
            sentence gives each rank's error and how each process ended. A process that fails in its teardown
            after every figure is in is not an error.
    """

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    got: dict = {"host": [], "links": [], "error": []}

    def drain():  # read as the figures come: a full pipe would block its writer
        while not queue.empty():
            kind, rank, value = queue.get()
            got[kind].append((rank, value))

    with tempfile.TemporaryDirectory(prefix="slapo_lab_calibrate_") as tmp:
        # a file rendezvous: no port to pick and lose to another process between picking and binding it
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        args = (world, init, tuple(sizes), repeats, queue, torch.get_num_threads(), host)
        procs = [ctx.Process(target=_collective_worker, args=(r, *args)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 600
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            drain()
            time.sleep(0.05)
        for p in procs:
            p.join(1)
            if p.is_alive():
                p.kill()
        drain()
    complete = bool(got["links"]) and (host is None or len(got["host"]) == world)
    if got["error"] or not complete:
        # with every figure in, a process that failed only in its teardown (gloo's threads can abort an exit)
        # cost nothing; anything else is named
        said = "; ".join(f"rank {r}: {msg}" for r, msg in got["error"]) or "no error reported"
        ends = ", ".join(f"rank {r} {_exit_reason(p.exitcode)}" for r, p in enumerate(procs))
        raise RuntimeError(
            f"calibrate(): a gloo collective process failed before its figures were in ({said}; {ends})."
        )
    times, overlap = got["links"][0][1]
    return times, overlap, (_slowest([v for _r, v in got["host"]]) if host is not None else None)


def op_overhead(device=None, n: int = 2000) -> float:
    """Seconds per eager ``torch.add`` of two 4-element tensors (the host's dispatch cost of one aten op, the
    kernel itself negligible), the fastest of 5 loops of ``n``."""

    a = torch.ones(4, device=device)
    b = torch.ones(4, device=device)

    def loop():
        for _ in range(n):
            torch.add(a, b)

    return _time(loop, 5) / n


def selective_op_overhead(device=None, n: int = 2000) -> float:
    """Seconds that torch's selective-checkpoint dispatch mode adds to one eager op: a loop of ``n`` tiny
    ``torch.add`` (of a tensor that requires grad, as a block's ops take) inside the forward context of
    ``create_selective_checkpoint_contexts`` with the policy :func:`slapo_lab.random.selective_policy` runs, less
    the same loop outside it; each the fastest of 5 loops, never below 0."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts  # noqa: PLC0415

    from ..random import selective_policy  # noqa: PLC0415

    a = torch.ones(4, device=device, requires_grad=True)
    b = torch.ones(4, device=device)

    def loop():
        for _ in range(n):
            torch.add(a, b)

    plain = _time(loop, 5)
    forward, _recompute = create_selective_checkpoint_contexts(selective_policy())
    with forward:
        under = _time(loop, 5)
    return max(under - plain, 0.0) / n


def copy_bandwidth(sizes, repeats: int = 5) -> dict[int, float]:
    """Bytes/s of ``clone`` (read + write; a fresh output, as every op makes one) of an fp32 CPU tensor of ``n``
    bytes, for each ``n`` in ``sizes``; repeated enough that every size runs for about the same time."""

    out = {}
    for n in sizes:
        x = torch.ones(n // 4)
        k = max(1, (64 << 20) // n)

        def run(x=x, k=k):
            for _ in range(k):
                x.clone()

        out[n] = 2 * n * k / _time(run, repeats)
    return out


def first_touch_cost(nbytes: int = 64 << 20, repeats: int = 7) -> float:
    """Seconds per byte that writing a freshly allocated CPU tensor of ``nbytes`` costs beyond writing one already
    in use: ``torch.empty(n).fill_(0)`` less a ``fill_`` of a kept tensor timed right after it, the median of
    ``repeats`` such pairs (each pair meets the same load from other processes), over ``nbytes``; 0 if not slower.
    ``nbytes`` should be past the allocator's mmap threshold (``DeviceProfile.fresh_page_bytes``)."""
    n = nbytes // 4
    kept = torch.ones(n)
    torch.empty(n).fill_(0)  # warm-up
    diffs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.empty(n).fill_(0)
        t1 = time.perf_counter()
        kept.fill_(0)
        diffs.append((t1 - t0) - (time.perf_counter() - t1))
    return max(0.0, sorted(diffs)[len(diffs) // 2] / nbytes)


def fit_link(times: dict[int, float], world: int = 2) -> tuple[float, float]:
    """``(bandwidth bytes/s, latency s)`` of a ring all-reduce fitted to ``times`` (bytes -> seconds):
    ``t = 2 (w - 1) latency + 2 (w - 1) / w * bytes / bandwidth`` by least squares over the sizes, each weighted
    by ``1 / t^2`` (relative errors: the sizes span four orders of magnitude, and an unweighted fit lets the
    largest size's noise decide the latency, which the small sizes measure)."""
    steps = 2 * (world - 1)
    xs = [steps / world * n for n in times]
    ys = list(times.values())
    ws = [1.0 / max(y, 1e-12) ** 2 for y in ys]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / sw
    var = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    cov = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True))
    slope = max(cov / var if var else 0.0, 1e-15)
    latency = max((my - slope * mx) / steps, 1e-7)
    return 1.0 / slope, latency


def calibrate(quick: bool = True) -> DeviceProfile:
    """Measure this machine and return its :class:`DeviceProfile`.

    Matmul FLOP/s: the best of ``torch.matmul`` on square fp32 (and bf16) matrices of 256 to 2048 (4096 unless
    ``quick``), and in the device's training dtype (fp32 on a CPU, bf16 on a GPU) from 64 up, each size's rate as
    a fraction of the best (``matmul_curve``); attention: a causal SDPA forward + backward
    (:func:`attention_flops`) over the best matmul rate (``attention_efficiency``); memory bandwidth: a 256 MiB
    ``clone`` (read + write); on a CPU also the cache: ``clone`` at working sets of 256 KiB to 64 MiB
    (``memory_curve``); the per-op dispatch time: a loop of tiny ``torch.add`` (:func:`op_overhead`), and what
    torch's selective-checkpoint mode adds to it (:func:`selective_op_overhead`) -- all of them
    :func:`host_rates`, which also times the optimizer step by tensor size (:func:`optimizer_rates`,
    ``optimizer_curve``) and, on a CPU, the page faults of a fresh 64 MiB output (:func:`first_touch_cost`,
    ``fresh_page_cost``). Links: a gloo ``all_reduce`` between two local processes of 1 KiB to 8 MiB, each the
    mean of a stream of calls, each call after a burst of compute as a step issues it (:func:`collective_times`),
    fitted as a ring (:func:`fit_link`), and on a CPU how much of an asynchronous all-reduce a matmul loop hides
    (``comm_overlap``; on a GPU NCCL's stream overlaps: 1.0, see the module docstring) -- on one machine the
    "intra" and "inter" links are the same loopback, so both get the fitted figures.

    On a CPU the ranks of a run share the machine (its cores, caches and memory bandwidth), so the two gloo
    processes measure :func:`host_rates` at the same time, and the profile keeps the slower one's figures. On a
    CUDA machine the calling process measures its GPU (each rank has its own). ``matmul_efficiency`` is 1 (the
    measured rate is what a matmul reaches) and the memory size is the machine's RAM (``os.sysconf``; the GPU's
    on CUDA). Every process runs on the calling process's threads (``torch.get_num_threads()``): set them as
    the ranks will have them (torchrun gives each rank one thread unless ``OMP_NUM_THREADS`` says otherwise).

    Returns:
        DeviceProfile named ``"calibrated <cpu|gpu name>"``.

    Raises:
        RuntimeError: a gloo process failed before its figures were in (:func:`collective_times`; one sentence
            with each rank's error and how each process ended).
    """

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sizes = (256, 512, 1024, 2048) if quick else (256, 512, 1024, 2048, 4096)
    if cuda:
        rates = host_rates(sizes, device)
        times, overlap, _ = collective_times()
    else:  # a CPU's ranks share it: each rank's figures measured while the others run too
        times, overlap, shared = collective_times(host=sizes)
        if shared is None:  # collective_times returns the host figures whenever host= is given
            raise RuntimeError("calibrate(): the gloo processes returned no host figures.")
        rates = shared
    by_size = rates["by_size"]
    best = max(by_size.values())
    fp32, bf16 = (rates["other"], best) if cuda else (best, rates["other"])
    matmul_curve = tuple((2.0 * n**3, rate / best) for n, rate in sorted(by_size.items()))
    attention = rates["attention"] / best
    copy = rates["copy"]
    curve = tuple(sorted(rates["curve"].items()))
    links = _link_fields(times, overlap, cuda)
    if cuda:
        name, mem = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory
    else:
        name, mem = "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # on CUDA the host's time to dispatch and launch one tiny kernel (it queues ahead of the GPU)
    overhead = rates["overhead"]
    return DeviceProfile(
        name=f"calibrated {name}",
        bf16_flops=bf16,
        fp32_flops=fp32,
        hbm_bytes=int(mem),
        hbm_bandwidth=copy,
        matmul_efficiency=1.0,
        memory_efficiency=1.0,
        source=f"sl.calibrate() on this machine ({time.strftime('%Y-%m-%d %H:%M')})",
        op_overhead=overhead,
        launch_async=cuda,
        memory_curve=tuple((int(n), float(v)) for n, v in curve),
        attention_efficiency=float(min(attention, 1.0)),
        matmul_curve=matmul_curve,
        optimizer_curve=tuple((int(n), float(v)) for n, v in sorted(rates["optimizer"].items())),
        fresh_page_cost=float(rates["fresh"]),
        selective_op_overhead=float(rates["selective"]),
        **links,
    )


def _link_fields(times: dict, overlap: float, cuda: bool) -> dict:
    """The :class:`DeviceProfile` fields of one :func:`collective_times` sample (``times`` as it returns them):
    the ring fitted to the all-reduce sizes (:func:`fit_link`) for both the "intra" and the "inter" link (on one
    machine both are the same loopback), the backend's all-gather / reduce-scatter against that ring at the
    largest size (``collective_scale``; none on CUDA), and ``comm_overlap`` (1.0 on CUDA: NCCL runs on its own
    stream, module docstring)."""
    times = dict(times)
    size = times.pop("size")
    slow = {op: times.pop(op) for op in ("all_gather", "reduce_scatter")}
    bw, lat = fit_link(times)
    # what the backend's all-gather / reduce-scatter take against the ring model of the fitted link (half an
    # all-reduce's bytes, half its steps, for 2 ranks)
    ring = size / 2 / bw + lat
    scale = () if cuda else tuple((op, max(1.0, t / ring)) for op, t in slow.items())
    return {
        "intra_bandwidth": bw,
        "intra_latency": lat,
        "inter_bandwidth": bw,
        "inter_latency": lat,
        "comm_overlap": 1.0 if cuda else float(min(1.0, max(0.0, overlap))),
        "collective_scale": scale,
    }


def link_sample() -> dict:
    """One more measurement of this machine's links, as :func:`calibrate` takes it (:func:`collective_times`
    between two gloo processes on the caller's threads, fitted as :func:`calibrate` fits it): the
    :class:`DeviceProfile` link fields (``intra_/inter_bandwidth`` bytes/s, ``intra_/inter_latency`` s,
    ``comm_overlap``, ``collective_scale``). About 20 s on a 2-core CPU.

    Raises:
        RuntimeError: as :func:`collective_times`.
    """
    times, overlap, _ = collective_times()
    return _link_fields(times, overlap, torch.cuda.is_available())


def link_fields(profile: DeviceProfile) -> dict:
    """``profile``'s link fields, as :func:`link_sample` returns them."""
    return {k: getattr(profile, k) for k in _LINK_FIELDS}


_LINK_FIELDS = (
    "intra_bandwidth",
    "intra_latency",
    "inter_bandwidth",
    "inter_latency",
    "comm_overlap",
    "collective_scale",
)


def with_median_links(profile: DeviceProfile, samples: list[dict]) -> DeviceProfile:
    """``profile`` with each link field the median of ``samples`` (:func:`link_sample` / :func:`link_fields`
    dicts; ``collective_scale`` per collective; an even count takes the mean of the middle two).

    A host shared with neighbours that come and go moves one link measurement by several times: the fitted gloo
    latency read 0.20-1.40 ms over fourteen calibrations of this project's 2-core CPU (2026-11-27/28;
    ``benchmarks/plan_ranking.py``'s docstring), where the steps those runs measured rank best priced at 0.6-0.9
    ms. Samples spread over the minutes a measurement takes, and their median, meet the load those minutes had.

    Raises:
        ValueError: ``samples`` is empty.
    """
    if not samples:
        raise ValueError("with_median_links(): no link samples.")
    out: dict = {}
    for k in _LINK_FIELDS:
        if k == "collective_scale":
            ops = {op for s in samples for op, _v in s[k]}
            out[k] = tuple(
                (op, statistics.median(dict(s[k]).get(op, 1.0) for s in samples)) for op in sorted(ops)
            )
        else:
            out[k] = float(statistics.median(s[k] for s in samples))
    return dataclasses.replace(profile, **out)


def replace(profile: DeviceProfile, **changes) -> DeviceProfile:
    """A copy of ``profile`` with ``changes`` (``dataclasses.replace``)."""
    return dataclasses.replace(profile, **changes)
