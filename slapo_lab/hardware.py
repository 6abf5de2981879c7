"""Peak dense FLOP/s of accelerators, by the name ``torch.cuda.get_device_name()`` reports: one table for the
training runtime's MFU (:mod:`slapo_lab.train.metrics`) and the planner's built-in device profiles
(:mod:`slapo_lab.planner.devices`).

Standard library only. Units: TFLOP/s (10^12 FLOP/s), dense (half the "with sparsity" figures).
"""

from __future__ import annotations

__all__ = ["PEAK_TFLOPS", "PRECISIONS", "peak_tflops_for"]

#: Peak dense TFLOP/s per GPU by precision: (bf16 tensor core, TF32 tensor core, FP32 without tensor cores), first
#: matching name wins; None where the GPU lacks that path. Sources: NVIDIA datasheets (H100 / H200 / B200, A100,
#: L40S, L40, L4, A10, V100, T4; B200's FP32 is the HGX B200 figure, an assumption per GPU), the Ada architecture
#: whitepaper (RTX 4090) and AMD's "Instinct MI300X Accelerator" datasheet (2023); SXM parts unless named.
PEAK_TFLOPS: list[tuple[str, tuple[float | None, float | None, float | None]]] = [
    ("B200", (2250.0, 1100.0, 80.0)), ("H200", (989.0, 494.0, 67.0)), ("H100 PCIe", (756.0, 378.0, 51.0)),
    ("H100", (989.0, 494.0, 67.0)), ("H800", (989.0, 494.0, 67.0)), ("A100", (312.0, 156.0, 19.5)),
    ("A800", (312.0, 156.0, 19.5)), ("L40S", (362.0, 183.0, 91.6)), ("L40", (181.0, 90.5, 90.5)),
    ("L4", (121.0, 60.0, 30.3)), ("A10", (125.0, 62.5, 31.2)), ("RTX 4090", (165.0, 82.6, 82.6)),
    ("MI300X", (1307.4, 653.7, 163.4)), ("V100", (None, None, 15.7)), ("T4", (None, None, 8.1)),
]  # fmt: skip
#: The columns of :data:`PEAK_TFLOPS`.
PRECISIONS = ("bf16", "tf32", "fp32")


def peak_tflops_for(device_name: str, precision: str) -> float | None:
    """Peak dense TFLOP/s of one GPU named ``device_name`` (``torch.cuda.get_device_name()``, or a built-in
    profile's name such as ``"H100 PCIe"``) in ``precision`` (``"bf16"``, ``"tf32"`` or ``"fp32"``), from
    :data:`PEAK_TFLOPS`; None when the GPU is not listed or lacks that path.

    Raises:
        ValueError: for another precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"The precision {precision!r} is not one of {', '.join(PRECISIONS)}.")
    column = PRECISIONS.index(precision)
    return next((value[column] for key, value in PEAK_TFLOPS if key in device_name), None)
