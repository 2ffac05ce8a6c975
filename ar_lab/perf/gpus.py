"""Real GPUs as data: the two roofs and the memory of each, from the vendor's own documents.

Chapter 05 places prefill and decode of real models on these rooflines
(``ar_lab.perf.llm_costs``) because most learners have no GPU to measure. Each row holds

* ``tensor_flops``: dense 16-bit tensor-core FLOP/s (bf16, or fp16 where the chip has no
  bf16), *without* 2:4 structured sparsity. Several datasheets print only the sparse
  figure, with a footnote that the dense one is half: the row then says so and halves it.
  Matmuls in PyTorch accumulate 16-bit products in fp32, so where a document gives both
  accumulation modes (GeForce cards run fp32 accumulation at half the fp16 rate) the row
  takes the fp32-accumulate figure.
* ``fp32_flops``: plain (non-tensor) fp32 FLOP/s, the roof of fp32 weights: PyTorch does
  not use TF32 for fp32 matmuls unless asked to. (AMD's CDNA matrix cores compute full fp32,
  and fp32 GEMMs run on them: the MI300X row takes that matrix figure.)
* ``bandwidth``: peak memory bandwidth in bytes/s; ``memory``: capacity in bytes, taken as
  the datasheet's GB x 10^9 (cards hold a little more in binary GiB, and the driver,
  the CUDA context and activations take some back).

All of them are peak figures at the boost clock, as datasheets print them: what the
chip cannot exceed, not what a program reaches (chapter 05 measures that where a GPU is
present). ``source`` names the document each row's numbers come from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ar_lab.base.errors import BadType, BadValue
from ar_lab.perf.roofline import ridge_point

GB = 1e9
TB = 1e12
TFLOP = 1e12

# The weight formats the roofs know (``ar_lab.perf.llm_costs.WEIGHT_BYTES`` counts their bytes), and
# the other spellings a learner reaches for: names in any case, and torch dtypes (read by name).
WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
SPELLINGS = {"float32": "fp32", "bfloat16": "bf16"}


def weight_format(weight_dtype) -> str:
    """The short name in ``WEIGHT_FORMATS`` of a weight format: "fp32", "FP32", "float32" and
    torch.float32 are all "fp32". Anything else is a ValueError listing the accepted values, never
    a neighbour's roof: a misspelt fp32 must not get the 16-bit tensor roof, 15x higher."""
    text = weight_dtype if isinstance(weight_dtype, str) else None
    if type(weight_dtype).__module__ == "torch" and type(weight_dtype).__name__ == "dtype":
        text = str(weight_dtype).removeprefix("torch.")
    if text is not None:
        text = text.strip().lower()
        text = SPELLINGS.get(text, text)
        if text in WEIGHT_FORMATS:
            return text
    raise BadValue(
        f"weight_dtype must be one of {list(WEIGHT_FORMATS)} (or 'float32', 'bfloat16', a torch "
        f"dtype such as torch.bfloat16), got {weight_dtype!r}",
        arg="weight_dtype",
    )


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator's datasheet roofs: dense tensor and fp32 FLOP/s, bandwidth, memory."""

    name: str
    tensor_flops: float  # dense 16-bit tensor-core FLOP/s (no sparsity)
    fp32_flops: float  # non-tensor fp32 FLOP/s
    bandwidth: float  # bytes/s
    memory: float  # bytes
    source: str  # the vendor document the figures come from
    quoted: str  # what the document prints for the tensor figure, and how the dense figure follows
    # regular expression matching torch.cuda.get_device_name() of this exact product
    device_names: str

    @property
    def ridge(self) -> float:
        """FLOP per byte where the 16-bit tensor roof meets the bandwidth slope."""
        return ridge_point(self.tensor_flops, self.bandwidth)

    def peak_flops(self, weight_dtype="bf16") -> float:
        """The compute roof for a weight format (any spelling ``weight_format`` takes): fp32 runs on
        the fp32 units; bf16, int8 and int4 weights (int8/int4 dequantized to bf16 for the
        arithmetic) on the 16-bit tensor cores."""
        return self.fp32_flops if weight_format(weight_dtype) == "fp32" else self.tensor_flops


GPUS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in [
        GPUSpec(
            "T4",
            65 * TFLOP,
            8.1 * TFLOP,
            300 * GB,
            16 * GB,
            source="NVIDIA T4 Tensor Core GPU datasheet",
            quoted="Mixed Precision (FP16/FP32) 65 TFLOPS (dense; Turing has no bf16). The "
            "datasheet gives 300 GB/s; NVIDIA's T4 web page says 320+ GB/s",
            device_names=r"\bT4\b",
        ),
        GPUSpec(
            "L4",
            242 * TFLOP / 2,
            30.3 * TFLOP,
            300 * GB,
            24 * GB,
            source="NVIDIA L4 Tensor Core GPU datasheet",
            quoted="FP16 / BF16 Tensor Core 242 TFLOPS, printed with sparsity: dense is half, 121",
            device_names=r"\bL4\b",
        ),
        GPUSpec(
            "A10",
            125 * TFLOP,
            31.2 * TFLOP,
            600 * GB,
            24 * GB,
            source="NVIDIA A10 Tensor Core GPU datasheet",
            quoted="BF16 / FP16 Tensor Core 125 TFLOPS dense (250 with sparsity). Not AWS's A10G: "
            "NVIDIA publishes no datasheet for that variant and its tensor throughput differs",
            device_names=r"\bA10\b",
        ),
        GPUSpec(
            "A100 40GB SXM",
            312 * TFLOP,
            19.5 * TFLOP,
            1555 * GB,
            40 * GB,
            source="NVIDIA A100 Tensor Core GPU datasheet",
            quoted="BF16 / FP16 Tensor Core 312 TFLOPS dense (624 with sparsity)",
            device_names=r"A100.*40GB",  # the 40 GB PCIe card has the same roofs
        ),
        GPUSpec(
            "A100 80GB SXM",
            312 * TFLOP,
            19.5 * TFLOP,
            2039 * GB,
            80 * GB,
            source="NVIDIA A100 Tensor Core GPU datasheet",
            quoted="BF16 / FP16 Tensor Core 312 TFLOPS dense (624 with sparsity)",
            device_names=r"A100-SXM\d?-80GB",
        ),
        GPUSpec(
            "H100 SXM",
            1979 * TFLOP / 2,
            67 * TFLOP,
            3.35 * TB,
            80 * GB,
            source="NVIDIA H100 Tensor Core GPU datasheet",
            quoted="BF16 / FP16 Tensor Core 1,979 TFLOPS, printed with sparsity: dense is half, "
            "989.5",
            # how the SXM5 module names itself (the PCIe card: "H100 PCIe")
            device_names=r"H100 80GB HBM3",
        ),
        GPUSpec(
            "H200 SXM",
            1979 * TFLOP / 2,
            67 * TFLOP,
            4.8 * TB,
            141 * GB,
            source="NVIDIA H200 Tensor Core GPU datasheet",
            quoted="BF16 / FP16 Tensor Core 1,979 TFLOPS, printed with sparsity: dense is half, "
            "989.5",
            device_names=r"\bH200\b(?!.*NVL)",
        ),
        GPUSpec(
            "B200 (HGX)",
            36 * 1000 * TFLOP / 8 / 2,
            600 * TFLOP / 8,
            64 * TB / 8,
            1440 * GB / 8,
            source="NVIDIA HGX B200 datasheet figures (the HGX platform's specifications for an "
            "8-GPU board: each figure here is one eighth)",
            quoted="FP16 / BF16 Tensor Core 36 PFLOPS for 8 GPUs, printed with sparsity: dense "
            "is half, 2,250 TFLOPS per GPU; HBM3e 1,440 GB and 64 TB/s for the board: 180 GB, 8 "
            "TB/s each",
            device_names=r"\bB200\b",
        ),
        GPUSpec(
            "MI300X",
            1307.4 * TFLOP,
            163.4 * TFLOP,
            5.3 * TB,
            192 * GB,
            source="AMD Instinct MI300X accelerator datasheet",
            quoted="Peak FP16 / BF16 1,307.4 TFLOPS dense (2,614.9 with sparsity); FP32 matrix "
            "163.4 TFLOPS (full fp32 on the matrix cores, where rocBLAS runs fp32 GEMMs; 81.7 on "
            "the vector units)",
            device_names=r"MI300X",
        ),
        GPUSpec(
            "RTX 4090",
            165.2 * TFLOP,
            82.6 * TFLOP,
            1008 * GB,
            24 * GB,
            source="NVIDIA Ada GPU Architecture whitepaper (GeForce RTX 4090 specifications)",
            quoted="Peak FP16 / BF16 Tensor TFLOPS with FP32 accumulate 165.2 dense (330.4 with "
            "sparsity); with FP16 accumulate 330.3, which PyTorch's matmuls do not use",
            device_names=r"RTX 4090$",
        ),
    ]
}


def match_gpu(device_name: str) -> GPUSpec | None:
    """The table's row for a CUDA device name (``torch.cuda.get_device_name()``), or None if not
    tabulated.

    Only the exact products of the table match: an "H100 PCIe" or an "A10G" has other
    roofs and gets None, not a neighbour's figures.
    """
    if not isinstance(device_name, str):
        raise BadType(
            "device_name must be a str (what torch.cuda.get_device_name() returns), got "
            f"{device_name!r}",
            arg="device_name",
        )
    for spec in GPUS.values():
        if re.search(spec.device_names, device_name.strip()):
            return spec
    return None


def gpu(name: str) -> GPUSpec:
    """The row named ``name`` (a key of ``GPUS``), with a clear error for anything else."""
    return _row(name, "name")


def _row(name, arg: str) -> GPUSpec:
    """The row named ``name``; else a BadValue for the argument ``arg`` listing the names."""
    if not isinstance(name, str) or name not in GPUS:
        raise BadValue(
            f"unknown GPU {name!r}; choose one of {list(GPUS)} (argument {arg})", arg=arg
        )
    return GPUS[name]


def as_gpu(value, name: str = "gpu", *, arg: str | None = None) -> GPUSpec:
    """``value`` if it is a ``GPUSpec``, the row it names if it is a name from ``GPUS``; else an
    error naming the argument ``name`` and what to pass (functions that take a GPU take either).
    ``arg``: the argument the error names as ``.arg`` when ``name`` describes a part of it (default:
    ``name``)."""
    arg = name if arg is None else arg
    if isinstance(value, GPUSpec):
        return value
    if isinstance(value, str):
        return _row(value, arg)
    raise BadType(
        f"{name} must be a GPUSpec or a name from GPUS such as 'H100 SXM', got {value!r}", arg=arg
    )


SPEC_HEADERS = [
    "GPU",
    "16-bit tensor TFLOP/s",
    "fp32 TFLOP/s",
    "bandwidth TB/s",
    "memory GB",
    "ridge FLOP/B",
    "source",
]


def spec_rows(specs=None) -> list[list]:
    """Rows under ``SPEC_HEADERS``: the table as a learner reads it, ridge computed. ``specs``: a
    list of ``GPUSpec`` rows or their names (default: the whole table)."""
    if isinstance(specs, (str, GPUSpec)) or not (specs is None or hasattr(specs, "__iter__")):
        raise BadType(
            f"specs must be a list of GPUSpec rows or names (e.g. ['H100 SXM']), got {specs!r}",
            arg="specs",
        )
    rows = []
    for s in (
        GPUS.values() if specs is None else [as_gpu(x, "each of specs", arg="specs") for x in specs]
    ):
        rows.append(
            [
                s.name,
                round(s.tensor_flops / TFLOP, 1),
                round(s.fp32_flops / TFLOP, 1),
                round(s.bandwidth / TB, 3),
                round(s.memory / GB),
                round(s.ridge),
                s.source,
            ]
        )
    return rows
