"""Per-microbatch index plans of the DeepSeek-V4 attention (research §8, §14.1).

Built once per microbatch from the GLOBAL `cu_seqlens*` of a BatchMeta and cached in `meta.cache`,
so every layer shares them and a context-parallel split can later slice them to a rank's rows plus
its left halo.

Legend:
    T  rows of the microbatch          W  window keys per query (n_win)
    C  compressed entries (all docs)   m  compression ratio   K  entries per query
    N  documents (incl. a trailing padding document)          R  RoPE frequencies

THD rules (research §8) encoded here:
- a document's rows are `cu_seqlens_padded[i] ..`; its first `L_i` rows are real, the rest padding;
- positions restart at 0 per document; window keys never reach before the document start;
- compression windows are aligned to each document start; a document of real length L yields
  floor(L / m) entries, the tail `L mod m` is not compressed (padding never enters an entry);
- the first window of a document has no "previous window" slots (overlap reset);
- row t of document i sees entry w of its own document iff w < min(floor((pos+1)/m), n_i).
Padding rows only read earlier rows of their own document, so they never influence a real row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from titan_thd.models.batch_meta import BatchMeta
from titan_thd.models.dsv4.args import DSv4Args
from titan_thd.models.dsv4.rope import cos_sin, inv_freq


@dataclass
class CompressPlan:
    ratio: int
    own_CM: torch.Tensor
    """[C, m] rows of the window an entry compresses."""
    prev_CM: torch.Tensor
    """[C, m] rows of the previous window of the same document (overlap slots), -1 for a first window."""
    pos_C: torch.Tensor
    """[C] document-local position w*m of each entry (where its RoPE angle is taken)."""
    start_T: torch.Tensor
    """[T] index of the first entry of the row's document."""
    n_vis_T: torch.Tensor
    """[T] entries of its document the row may use (causal at block granularity)."""
    max_entries: int
    """Largest entry count of one document: K of an 'all visible entries' index."""
    cos_CR: torch.Tensor
    sin_CR: torch.Tensor
    _visible: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_entries(self) -> int:
        return int(self.own_CM.shape[0])

    def visible(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """[hi-lo, max_entries] entries visible to rows lo..hi (-1 for unused slots)."""
        start, n_vis = self.start_T[lo:hi], self.n_vis_T[lo:hi]
        slot_K = torch.arange(self.max_entries, device=start.device)
        return torch.where(slot_K < n_vis[:, None], start[:, None] + slot_K, -1)

    def visible_all(self) -> torch.Tensor:
        """`visible()` of every row, kept (HCA layers all use it)."""
        if self._visible is None:
            self._visible = self.visible()
        return self._visible


@dataclass
class BatchPlan:
    pos_T: torch.Tensor
    doc_T: torch.Tensor
    real_T: torch.Tensor
    """[T] bool: the row is a real token (not per-document or tail padding)."""
    window_TW: torch.Tensor
    """[T, W] rows of the window keys of each query, -1 before its document start."""
    rope_main: tuple[torch.Tensor, torch.Tensor]
    """cos_TR, sin_TR of sliding-only layers (rope_theta)."""
    rope_comp: tuple[torch.Tensor, torch.Tensor]
    """cos_TR, sin_TR of CSA / HCA layers (compress θ + YaRN)."""
    compress: dict[str, CompressPlan]
    """"csa" / "hca" -> plan (present when a layer of that type exists)."""


def rope_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def build_plan(meta: BatchMeta, args: DSv4Args, dtype: torch.dtype) -> BatchPlan:
    """Plan of the whole (global) microbatch described by `meta`, on `meta.device`."""
    cu = meta.cu_seqlens.long()
    cu_pad = meta.cu_seqlens_padded.long()
    T = int(cu_pad[-1])
    device = meta.device
    if meta.local_tokens != T:
        raise ValueError(f"dsv4: meta has {meta.local_tokens} position_ids but cu_seqlens_padded[-1] = {T}")
    lens_N, plens_N, starts_N = cu[1:] - cu[:-1], cu_pad[1:] - cu_pad[:-1], cu_pad[:-1]
    doc_T = torch.repeat_interleave(torch.arange(len(plens_N)), plens_N)
    pos_T = torch.arange(T) - starts_N[doc_T]
    if not torch.equal(pos_T.to(device), meta.position_ids.long()):
        raise ValueError(
            "dsv4: position_ids do not restart at the document starts given by cu_seqlens_padded"
        )
    real_T = pos_T < lens_N[doc_T]

    offsets_W = torch.arange(-args.window + 1, 1)
    window_TW = torch.arange(T)[:, None] + offsets_W
    window_TW = torch.where(window_TW >= starts_N[doc_T][:, None], window_TW, -1)

    rdt = rope_dtype(dtype)
    freq_main, freq_comp = inv_freq(args, False, rdt), inv_freq(args, True, rdt)
    compress = {}
    for kind in sorted(set(args.layer_types) - {"sliding"}):
        m = args.ratios[kind]
        n_c_N = lens_N // m
        cu_c_N = torch.cat([torch.zeros(1, dtype=torch.long), n_c_N.cumsum(0)])
        doc_C = torch.repeat_interleave(torch.arange(len(n_c_N)), n_c_N)
        w_C = torch.arange(int(cu_c_N[-1])) - cu_c_N[doc_C]
        own_CM = (starts_N[doc_C] + w_C * m)[:, None] + torch.arange(m)
        prev_CM = torch.where((w_C > 0)[:, None], own_CM - m, -1)
        pos_C = w_C * m
        cos_CR, sin_CR = cos_sin(pos_C, freq_comp)
        compress[kind] = CompressPlan(
            ratio=m,
            own_CM=own_CM.to(device),
            prev_CM=prev_CM.to(device),
            pos_C=pos_C.to(device),
            start_T=cu_c_N[doc_T].to(device),
            n_vis_T=torch.minimum((pos_T + 1) // m, n_c_N[doc_T]).to(device),
            max_entries=int(n_c_N.max()) if len(n_c_N) else 0,
            cos_CR=cos_CR.to(device),
            sin_CR=sin_CR.to(device),
        )
    return BatchPlan(
        pos_T=pos_T.to(device),
        doc_T=doc_T.to(device),
        real_T=real_T.to(device),
        window_TW=window_TW.to(device),
        rope_main=tuple(t.to(device) for t in cos_sin(pos_T, freq_main)),
        rope_comp=tuple(t.to(device) for t in cos_sin(pos_T, freq_comp)),
        compress=compress,
    )


def get_plan(meta: BatchMeta, args: DSv4Args, dtype: torch.dtype) -> BatchPlan:
    """The cached plan of this microbatch (one build per microbatch, shared by all layers)."""
    if meta.cp.size > 1:
        local = meta.total_tokens // meta.cp.size
        if local < args.halo:
            raise ValueError(
                f"dsv4: context parallelism needs at least {args.halo} tokens per rank (window "
                f"{args.window}, CSA 2*m = {2 * args.csa_ratio}, HCA m' = {args.hca_ratio}); got "
                f"T = {meta.total_tokens} / cp {meta.cp.size} = {local}"
            )
        raise NotImplementedError("dsv4 context parallelism is added by the CP issue")
    key = "dsv4.plan:" + repr(
        (
            args.window,
            args.csa_ratio,
            args.hca_ratio,
            sorted(set(args.layer_types)),
            args.rope_dim,
            args.rope_theta,
            args.compress_rope_theta,
            args.rope_factor,
            args.rope_original_max_pos,
            args.rope_beta_fast,
            args.rope_beta_slow,
            rope_dtype(dtype),
        )
    )
    return meta.cached(key, lambda: build_plan(meta, args, dtype))
