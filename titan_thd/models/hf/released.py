"""Write a model in a release's own format: FP8 / packed FP4 codes with power-of-two block scales
(models/hf/quant.py `encode`), everything else as the release stores it; streamed through models/hf/
export.py like any export (one tensor encoded at a time).

    plan, qconfig = folder_plan("DeepSeek-V4-Flash")        # how that folder stores each tensor
    enc = ReleaseEncoder(plan, survival=Survival(...))       # export's `encode` hook
    export(spec, source, args, out, encode=enc, config_extra={"quantization_config": qconfig})
    print(enc.report())

    plan = family_plan(adapter.released, names, (128, 128))   # to-release: the family's published layout

`scripts/convert_hf.py to-hf --dtype released` writes a run whose base is a release folder this way
(the folder's names, dtypes, scale names and blocks; its quantization_config); `to-release` writes any
HF folder of a family with a published release format (`HFAdapter.released`).

For a LoRA run, `Survival` measures per target what the re-encoding keeps of the update:
`||Q(W + dW) - Q(W)|| / ||dW||` over the target's tensors, W the base as the folder decodes it,
W + dW the merged float32 weight, Q = decoded(encode(.)); with the part of it along dW, the error
against the float merge and the update's size (docs/lora.md §7 reads them). Q(W) is W itself when
the folder's scales are powers of two (quant.py's encoder: a decodable value re-encodes to itself);
it is computed otherwise.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_thd.models.dsv4.hf_dequant import check_quantization_config, quantized_sources
from titan_thd.models.hf.folder import HFFolder
from titan_thd.models.hf.io import SafetensorsFolder
from titan_thd.models.hf.quant import Format, decoded, encode, stored


@dataclass(frozen=True)
class StoredAs:
    """How a folder stores one tensor."""

    dtype: torch.dtype | None
    """The stored dtype: a plain tensor's (None: as the model holds it), or the codes' (float8_e4m3fn;
    int8 / uint8 packed FP4)."""
    fmt: Format | None = None
    """The block format of a quantised weight; None for a plain tensor."""
    scale: str = ""
    """The name of a quantised weight's scale tensor (`<m>.scale` in DeepSeek's release)."""
    scale_dtype: torch.dtype | None = None
    """The scales' stored dtype (float8_e8m0fnu, its byte as uint8, or float32)."""
    shape: tuple[int, ...] = ()
    """The values' shape (packed FP4: twice the stored columns); () = not checked."""


RELEASE_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "scale_fmt": "ue8m0",
}
"""DeepSeek-V4's `quantization_config` (docs/dsv4.md §17), with the FP8 block filled in by `to-release`."""


def folder_plan(path: str | Path) -> tuple[dict[str, StoredAs], dict]:
    """({stored name: StoredAs} of every tensor of a folder but its scales, its config.json's
    quantization_config), from the headers; ValueError for a folder that stores nothing block-quantised."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    block = check_quantization_config(config, f"{path}/config.json")
    folder = SafetensorsFolder(path)
    quantized, scales = quantized_sources(folder.tensors, block)
    if block is None or not quantized:
        raise ValueError(
            f"{path}: not a release-format folder (config.json has no quantization_config, or no tensor is "
            "stored FP8 / FP4 with a scale); --dtype released writes a run whose base is such a folder "
            "(use --dtype bfloat16 / float32)"
        )
    plan = {}
    for name, s in folder.tensors.items():
        if name in scales:
            continue
        q = quantized.get(name)
        if q is None:
            plan[name] = StoredAs(s.dtype, shape=s.shape)
        else:
            plan[name] = StoredAs(s.dtype, q.format, q.scale.name, q.scale.dtype, tuple(q.shape))
    return plan, config["quantization_config"]


def family_plan(
    released, names: dict[str, tuple[str, tuple[int, ...]]], block: tuple[int, int]
) -> dict[str, StoredAs]:
    """{stored name: StoredAs} of a family's published release (`released`: HFAdapter.released) for
    `names` {stored name: (our key, our tensor's shape)}: FP8 e4m3 in `block` blocks, packed FP4
    int8 with 1 x 32 blocks, e8m0 scales named `<m>.scale`; None formats stay as they are (dtype
    None: kept). ValueError for an FP4 tensor whose columns are not whole 1 x 32 blocks."""
    plan = {}
    for name, (key, shape) in names.items():
        fmt = released(key, shape)
        if fmt is None:
            plan[name] = StoredAs(None)
            continue
        if fmt.kind == "fp4":
            if shape[-1] % fmt.block[1]:
                raise ValueError(
                    f"{name}: {shape[-1]} columns are not whole {fmt.block[0]} x {fmt.block[1]} FP4 blocks, "
                    "which the release format needs"
                )
            plan[name] = StoredAs(
                torch.int8, fmt, name.removesuffix("weight") + "scale", torch.float8_e8m0fnu
            )
        else:
            fp8 = Format("fp8", block, 1)
            plan[name] = StoredAs(
                torch.float8_e4m3fn, fp8, name.removesuffix("weight") + "scale", torch.float8_e8m0fnu
            )
    return plan


class Survival:
    """Per LoRA target, sums of ||Q(W + dW) - Q(W)||^2 and ||dW||^2 over its tensors (module doc)."""

    def __init__(self, base: str | Path, targets: dict[str, str]):
        """`base`: the base folder; `targets`: {our key of an adapted tensor: its target's name}."""
        self.folder = SafetensorsFolder(base)
        config = json.loads((Path(base) / "config.json").read_text())
        self.sources, _ = quantized_sources(self.folder.tensors, check_quantization_config(config, str(base)))
        self.targets = targets
        self.sums: dict[str, list[float]] = {}

    def add(self, key: str, name: str, merged: torch.Tensor, how: StoredAs, q_merged: torch.Tensor) -> None:
        target = self.targets.get(key)
        source = self.sources.get(name)
        if target is None or source is None:
            return
        w = source.read(self.folder, tuple(slice(0, n) for n in source.shape))
        self.folder.close()
        q_w = (
            w
            if how.scale_dtype in (torch.float8_e8m0fnu, torch.uint8)
            else decoded(*encode(w, how.fmt), how.fmt)
        )
        kept, dw = q_merged.double() - q_w.double(), merged.double() - w.double()
        sums = self.sums.setdefault(target, [0.0, 0.0, 0.0, 0.0, 0.0, 0])
        sums[0] += float(kept.square().sum())
        sums[1] += float(dw.square().sum())
        sums[2] += float((kept * dw).sum())
        sums[3] += float(w.double().square().sum())
        sums[4] += float((q_merged.double() - merged.double()).square().sum())
        sums[5] += 1

    def lines(self) -> list[str]:
        """One line per target and per group (`attention.wq_a` -> `attention`)."""
        groups: dict[str, list[float]] = {}
        out = []
        for target, sums in sorted(self.sums.items()):
            g = groups.setdefault(target.split(".")[0], [0.0, 0.0, 0.0, 0.0, 0.0, 0])
            for i, v in enumerate(sums):
                g[i] += v
            out.append(f"  {target}: {_fraction(*sums)}")
        out += [f"  {g} (group): {_fraction(*sums)}" for g, sums in groups.items()]
        return out


def _fraction(kept: float, update: float, along: float, base: float, error: float, n: int) -> str:
    """The norm ratio, the part along dW (<Q(W + dW) - Q(W), dW> / ||dW||^2: 1 = the update kept,
    0 = lost; a ratio above it is rounding noise, not update), the re-encoding's error against the
    float merge ||Q(W + dW) - (W + dW)|| / ||dW|| and the update's size ||dW|| / ||W||."""
    if update == 0:
        return f"no update (dW = 0), {n} tensors"
    return (
        f"{math.sqrt(kept / update):.4f} of the update survives (norm ratio), {along / update:.4f} of it along dW, "
        f"error {math.sqrt(error / update):.3g} x ||dW||, ||dW|| / ||W|| = {math.sqrt(update / base):.2e}, {n} tensors"
    )


class ReleaseEncoder:
    """models/hf/export.py's `encode` hook: (our key, stored name, tensor) -> the stored tensors."""

    def __init__(self, plan: dict[str, StoredAs], survival: Survival | None = None):
        self.plan, self.survival = plan, survival
        self.written: set[str] = set()
        self.unplanned: list[str] = []

    def __call__(self, key: str, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        how = self.plan.get(name)
        self.written.add(name)
        if how is None:  # the base does not store it (e.g. a module it lacks): as the run holds it
            self.unplanned.append(name)
            yield name, tensor
            return
        if how.shape and tuple(tensor.shape) != how.shape:
            raise ValueError(f"{name}: the model's {list(tensor.shape)} is not the base's {list(how.shape)}")
        if how.fmt is None:
            cast = tensor if how.dtype is None else tensor.to(how.dtype)
            # an index table stored as floats (or the reverse) must come back exactly
            if not tensor.is_floating_point() and not torch.equal(cast.to(tensor.dtype), tensor):
                raise ValueError(f"{name}: its {tensor.dtype} values do not fit the base's {how.dtype}")
            yield name, cast
            return
        if tensor.dtype == torch.float64:  # a float64 master: encoded from its float32 export's values
            tensor = tensor.float()
        try:
            codes, exps = encode(tensor, how.fmt)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if self.survival is not None:
            self.survival.add(key, name, tensor, how, decoded(codes, exps, how.fmt))
        weight, scale = stored(codes, exps, how.dtype, how.scale_dtype)
        yield name, weight
        yield how.scale, scale

    def report(self) -> list[str]:
        """What the export's reader should know: tensors the base stores that were not written,
        tensors written that the base does not store, and the survival per target."""
        out = []
        skipped = sorted(set(self.plan) - self.written)
        if skipped:
            out.append(
                f"not written: {len(skipped)} tensors of the base the model has no place for, e.g. {skipped[:3]}"
            )
        if self.unplanned:
            out.append(
                f"written as trained: {len(self.unplanned)} tensors the base does not store, e.g. {self.unplanned[:3]}"
            )
        if self.survival is not None:
            out.append("merged into the release format, ||Q(W + dW) - Q(W)|| / ||dW|| per target:")
            out += self.survival.lines()
        return out


def _stored_dtype(source) -> torch.dtype:
    """The dtype a source reads as: a plain stored tensor's, float32 for a dequantised one."""
    for attr in ("stored", "inner", "parts"):
        inner = getattr(source, attr, None)
        if isinstance(inner, list):
            return _stored_dtype(inner[0])
        if attr == "stored" and inner is not None:
            return inner.dtype
        if inner is not None:
            return _stored_dtype(inner)
    return torch.float32


class FolderSource:
    """The tensors of an HF folder under our names (models/hf/write.py's source protocol), read
    one group at a time (FP8 / FP4 dequantised): what `write_release` re-encodes."""

    def __init__(self, folder: SafetensorsFolder, sources: dict):
        self.folder, self.sources = folder, sources

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(s.shape), _stored_dtype(s)) for k, s in self.sources.items()}

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {
            k: self.sources[k].read(self.folder, tuple(slice(0, n) for n in self.sources[k].shape))
            for k in names
        }
        self.folder.close()
        return out


def parse_block(text: str) -> tuple[int, int]:
    """(rows, cols) of `--fp8-block ROWSxCOLS`; ValueError naming the value otherwise."""
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if m is None or int(m[1]) <= 0 or int(m[2]) <= 0:
        raise ValueError(f"--fp8-block {text!r}: expected ROWSxCOLS, e.g. 128x128 (the release's) or 16x16")
    return int(m[1]), int(m[2])


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
)


def write_release(
    spec, folder: HFFolder, out: str | Path, block: tuple[int, int], max_shard_size: int
) -> ReleaseEncoder:
    """Any HF folder of a family with a published release format (`HFAdapter.released`), opened once
    (models/hf/folder.py) -> that format under `out` (FP8 in `block` blocks, packed FP4 experts, the
    rest as the folder stores it; its quantization_config; the tokenizer files copied), one tensor
    encoded at a time."""
    import shutil

    from titan_thd.models.hf.export import export

    adapter = folder.adapter
    if adapter.released is None:
        raise ValueError(
            f"model {spec.name} has no published release format to write (its HFAdapter.released is None)"
        )
    src, out, args = folder.path, Path(out), folder.args
    source = FolderSource(folder.headers, folder.sources(args))
    names = {}
    for key, (shape, _) in source.entries().items():
        for name, _t in adapter.to_hf(key, torch.empty(shape, device="meta")):
            names[name] = (key, shape)
    encoder = ReleaseEncoder(family_plan(adapter.released, names, block))
    extra = {"quantization_config": RELEASE_QUANTIZATION | {"weight_block_size": list(block)}}
    extra |= {k: folder.config[k] for k in ("dtype", "torch_dtype") if k in folder.config}
    export(spec, source, args, out, None, max_shard_size=max_shard_size, encode=encoder, config_extra=extra)
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return encoder
