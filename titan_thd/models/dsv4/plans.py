"""Per-microbatch index plans of the DeepSeek-V4 attention (docs/dsv4.md §8, §9, §14.1).

Built once per microbatch from the GLOBAL `cu_seqlens*` of a BatchMeta and cached in `meta.cache`,
so every layer shares them.

Legend:
    T  this rank's query rows (the whole microbatch without CP, T_full / cp under contiguous CP)
    R  key rows = left halo + T (the halo is empty without CP)
    W  window keys per query (n_win)   C  compressed entries   m  compression ratio
    N  documents (incl. a trailing padding document)            R/2 RoPE frequencies (cos_R, sin_R)

THD rules (docs/dsv4.md §8) encoded here:
- a document's rows are `cu_seqlens_padded[i] ..`; its first `L_i` rows are real, the rest padding;
- positions restart at 0 per document; window keys never reach before the document start;
- compression windows are aligned to each document start; a document of real length L yields
  floor(L / m) entries, the tail `L mod m` is not compressed (padding never enters an entry);
- the first window of a document has no "previous window" slots (overlap reset);
- row t of document i sees entry w of its own document iff w < min(floor((pos+1)/m), n_i).
Padding rows only read earlier rows of their own document, so they never influence a real row.

Contiguous context parallelism (docs/dsv4.md §9.2): rank r holds rows [r*T, (r+1)*T) of the full
microbatch and receives the last `halo` attention-input rows of rank r-1, so its key rows are
[r*T - halo, (r+1)*T). Window indices point into those key rows. A compressed entry is computed
only by the rank holding its window's last token (its rows, overlap included, lie within the key
rows because halo >= 2m and >= m'); every rank contributes `capacity` rows to an all-gather and
`gather_C` maps each entry of the microbatch (document-major, the single-process order) to its row
of the gathered buffer. Entry ids seen by queries (start_T, top-k, visibility) stay global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_thd.data.batch_meta import BatchMeta
from titan_thd.models.dsv4.args import CP_MODE, DSv4Args
from titan_thd.models.dsv4.rope import cos_sin, inv_freq
from titan_thd.parallel.context_parallel import check_layout, resolve_mode

CosSin = tuple[torch.Tensor, torch.Tensor]


@dataclass
class CompressPlan:
    ratio: int
    own_CM: torch.Tensor
    """[C_mine, m] key rows of the window of each entry this rank computes."""
    prev_CM: torch.Tensor | None
    """[C_mine, m] key rows of the previous window of the same document (overlap slots), -1 for a
    document's first window; None for a layer type without overlap (HCA)."""
    pos_C: torch.Tensor
    """[C_mine] document-local position w*m of each entry (where its RoPE angle is taken)."""
    start_T: torch.Tensor
    """[T] index of the first entry of the row's document (microbatch-wide entry ids)."""
    n_vis_T: torch.Tensor
    """[T] entries of its document the row may use (causal at block granularity)."""
    max_entries: int
    """Largest entry count of one document: K of an 'all visible entries' index."""
    cos_CR: torch.Tensor
    sin_CR: torch.Tensor
    num_entries: int
    """Entries of the whole microbatch (every rank's)."""
    capacity: int = 0
    """Rows each CP rank contributes to the entry all-gather (0 without CP)."""
    gather_C: torch.Tensor | None = None
    """[num_entries] row of the all-gathered buffer holding each entry (None without CP)."""

    def visible(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """[hi-lo, max_entries] entries visible to rows lo..hi (-1 for unused slots)."""
        start, n_vis = self.start_T[lo:hi], self.n_vis_T[lo:hi]
        slot_K = torch.arange(self.max_entries, device=start.device)
        return torch.where(slot_K < n_vis[:, None], start[:, None] + slot_K, -1)


@dataclass
class BatchPlan:
    pos_T: torch.Tensor
    real_T: torch.Tensor
    """[T] bool: the row is a real token (not per-document or tail padding)."""
    rows: slice
    """Rows of the full microbatch that this rank's queries are."""
    doc_full: torch.Tensor
    """[T_full] document of every row of the full microbatch (MTP targets look one row ahead)."""
    halo: int
    """Key rows before the first query: the CP left halo (0 without CP)."""
    window_TW: torch.Tensor
    """[T, W] key rows of the window keys of each query, -1 before its document start."""
    rope_main: CosSin
    """cos_RR, sin_RR of the key rows in sliding-only layers (rope_theta); queries use [halo:]."""
    rope_comp: CosSin
    """cos_RR, sin_RR of the key rows in CSA / HCA layers (compress θ + YaRN)."""
    compress: dict[str, CompressPlan]
    """"csa" / "hca" -> plan (present when a layer of that type exists)."""
    group: dist.ProcessGroup | None = None
    """The CP group (None without CP)."""

    def rope(self, layer_type: str) -> tuple[CosSin, CosSin]:
        """(key-row RoPE, query-row RoPE) of a layer type."""
        keys = self.rope_main if layer_type == "sliding" else self.rope_comp
        return keys, (keys[0][self.halo :], keys[1][self.halo :])


def rope_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _local_rows(meta: BatchMeta, args: DSv4Args, T_full: int) -> tuple[int, int, int]:
    """(first, end, halo) of this rank's query rows; refuses CP layouts the model cannot compute."""
    cp = meta.cp
    if cp.size == 1:
        if meta.local_tokens != T_full:
            raise ValueError(
                f"dsv4: meta has {meta.local_tokens} position_ids but cu_seqlens_padded[-1] = {T_full}"
            )
        return 0, T_full, 0
    # The Trainer checked these rules at start-up; a hand-built meta meets the same ones here.
    resolve_mode(cp.mode, "dsv4", CP_MODE)
    check_layout(
        cp=cp.size,
        mode=CP_MODE,
        T=T_full,
        min_tokens_per_rank=args.halo,
        where="dsv4: T",
        model="dsv4",
        why=f" (its halo: window {args.window}, CSA 2*m = {2 * args.csa_ratio}, HCA m' = {args.hca_ratio})",
    )
    local = T_full // cp.size
    lo, hi = cp.rank * local, (cp.rank + 1) * local
    if meta.row_index is None or not torch.equal(meta.row_index.cpu(), torch.arange(lo, hi, device="cpu")):
        raise ValueError(
            f"dsv4: CP rank {cp.rank} of {cp.size} must hold rows {lo}..{hi} of the microbatch (the contiguous "
            "split of titan_thd.data.cp_partition.partition); meta.row_index says otherwise"
        )
    return lo, hi, args.halo


def _compress_plan(
    *,
    kind: str,
    m: int,
    lens_N: torch.Tensor,
    starts_N: torch.Tensor,
    doc_T: torch.Tensor,
    pos_T: torch.Tensor,
    rows: tuple[int, int, int],
    cp_size: int,
    freq_R: torch.Tensor,
    device: torch.device,
) -> CompressPlan:
    lo, hi, halo = rows
    key_lo = lo - halo
    host = lens_N.device  # built where build_plan's inputs are (the host), moved to `device` at the end
    n_c_N = lens_N // m
    cu_c_N = torch.cat([torch.zeros(1, dtype=torch.long, device=host), n_c_N.cumsum(0)])
    C = int(cu_c_N[-1])
    doc_C = torch.repeat_interleave(torch.arange(len(n_c_N), device=host), n_c_N, output_size=C)
    w_C = torch.arange(C, device=host) - cu_c_N[doc_C]
    own_CM = (starts_N[doc_C] + w_C * m)[:, None] + torch.arange(m, device=host)
    last_C = own_CM[:, -1]
    mine_C = (last_C >= lo) & (last_C < hi)
    own_CM, w_mine = own_CM[mine_C] - key_lo, w_C[mine_C]
    prev_CM = None
    if kind == "csa":
        prev_CM = torch.where((w_mine > 0)[:, None], own_CM - m, -1)
    reach_C = own_CM[:, 0] - (m * (w_mine > 0) if kind == "csa" else 0)
    assert bool((reach_C >= 0).all()), "an entry reads rows left of the CP halo"
    capacity, gather_C = 0, None
    if cp_size > 1:
        # The own windows of distinct entries are disjoint, and those ending in a rank's T rows lie
        # within T + m - 1 rows: at most ceil(T / m) of them (the halo adds no entries).
        capacity = -(-(hi - lo) // m)
        owner_C = torch.div(last_C, hi - lo, rounding_mode="floor")
        count_P = torch.bincount(owner_C, minlength=cp_size)
        assert int(count_P.max()) <= capacity, (count_P, capacity)
        first_P = torch.cumsum(count_P, 0) - count_P
        gather_C = owner_C * capacity + torch.arange(C, device=host) - first_P[owner_C]
    pos_C = w_mine * m
    cos_CR, sin_CR = cos_sin(pos_C, freq_R)
    return CompressPlan(
        ratio=m,
        own_CM=own_CM.to(device),
        prev_CM=None if prev_CM is None else prev_CM.to(device),
        pos_C=pos_C.to(device),
        start_T=cu_c_N[doc_T].to(device),
        n_vis_T=torch.minimum((pos_T + 1) // m, n_c_N[doc_T]).to(device),
        max_entries=int(n_c_N.max()) if len(n_c_N) else 0,
        cos_CR=cos_CR.to(device),
        sin_CR=sin_CR.to(device),
        num_entries=C,
        capacity=capacity,
        gather_C=None if gather_C is None else gather_C.to(device),
    )


def build_plan(meta: BatchMeta, args: DSv4Args, dtype: torch.dtype) -> BatchPlan:
    """Plan of this rank's rows of the microbatch described by `meta`, on `meta.device`."""
    cu = meta.cu_seqlens.long()
    cu_pad = meta.cu_seqlens_padded.long()
    # The plan is index arithmetic on the host, next to cu_seqlens (BatchMeta keeps it on the CPU;
    # int() / .tolist() of it cost no device sync), moved to meta.device once at the end.
    host = cu_pad.device
    T_full = int(cu_pad[-1])
    lo, hi, halo = _local_rows(meta, args, T_full)
    lens_N, plens_N, starts_N = cu[1:] - cu[:-1], cu_pad[1:] - cu_pad[:-1], cu_pad[:-1]
    doc_full = torch.repeat_interleave(torch.arange(len(plens_N), device=host), plens_N, output_size=T_full)
    pos_full = torch.arange(T_full, device=host) - starts_N[doc_full]
    doc_T, pos_T = doc_full[lo:hi], pos_full[lo:hi]
    if not torch.equal(pos_T.to(meta.device), meta.position_ids.long()):
        raise ValueError(
            "dsv4: position_ids do not restart at the document starts given by cu_seqlens_padded"
        )
    key_lo = lo - halo
    window_TW = torch.arange(lo, hi, device=host)[:, None] + torch.arange(-args.window + 1, 1, device=host)
    window_TW = torch.where(window_TW >= starts_N[doc_T][:, None], window_TW - key_lo, -1)
    # Rank 0's halo rows are zeros before row 0 that no query reads; any angle will do.
    pos_R = pos_full[torch.arange(key_lo, hi, device=host).clamp(min=0)]

    rdt = rope_dtype(dtype)
    freq_main, freq_comp = inv_freq(args, False, rdt), inv_freq(args, True, rdt)
    compress = {
        kind: _compress_plan(
            kind=kind,
            m=args.ratios[kind],
            lens_N=lens_N,
            starts_N=starts_N,
            doc_T=doc_T,
            pos_T=pos_T,
            rows=(lo, hi, halo),
            cp_size=meta.cp.size,
            freq_R=freq_comp,
            device=meta.device,
        )
        for kind in sorted(set(args.layer_types) - {"sliding"})
    }
    device = meta.device
    return BatchPlan(
        pos_T=pos_T.to(device),
        real_T=(pos_T < lens_N[doc_T]).to(device),
        rows=slice(lo, hi),
        doc_full=doc_full.to(device),
        halo=halo,
        window_TW=window_TW.to(device),
        rope_main=tuple(t.to(device) for t in cos_sin(pos_R, freq_main)),
        rope_comp=tuple(t.to(device) for t in cos_sin(pos_R, freq_comp)),
        compress=compress,
        group=meta.cp.group if meta.cp.size > 1 else None,
    )


def get_plan(meta: BatchMeta, args: DSv4Args, dtype: torch.dtype) -> BatchPlan:
    """The cached plan of this microbatch (one build per microbatch, shared by all layers)."""
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
