"""Cached decoding of the DeepSeek-V4 model: window keys, compressed entries and indexer keys.

Legend:  N sequences   n mHC streams   d model width   D head dim   W window   m compression ratio
         C entries   I indexer head dim   HI indexer heads   S rows of a step's key buffer

What a new token at position p reads of its past, per attention layer (docs/dsv4.md §2-§4, §8):
- its window: the K=V rows of positions p-W+1 .. p (RMSNorm + RoPE of each row's own input);
- CSA / HCA: the compressed entries of its sequence's complete windows (entry w pools the attention
  inputs of window w, and with CSA's overlap of window w-1; a window completes at p+1 = (w+1) m);
- CSA: the lightning indexer's keys of the same windows, scored against the new query for its top-k.
Everything else (mHC mixing, norms, the MoE, the head) is per token. So the cache of one sequence
and layer is: the last W-1 K=V rows, the last 2m attention inputs (to form the next entry when its
window completes), the entries, and on CSA layers the indexer's entries. The sliding window makes
the K=V part constant-size; entries grow as length / m.

Prefill is the model's own packed forward over the prompts (a pre-hook on every attention records
its input rows and plan; the cache is computed from them by the layer's own modules, so the entries
are exactly those the forward attended). A decode step runs the block of block.py for one row per
sequence with the same modules, and each query attends an explicit row list of one key buffer
(window rows, then entries: all of them for HCA, the indexer's top-k for CSA, chosen by
Indexer.select with its lower-index tie rule) through the same sparse attention kernel, in one
softmax with the sink. Cached decoding equals the full forward to rounding (float64, relative
1e-12: tests/inference/test_decoders.py); the selection cannot differ, since both sides score the
same entries with the same tie rule. It reads only the public surface of the layer's modules
(`Attention.up_proj` / `attend`, `Compressor`, `Indexer.select`), so it lives here, beside them:
`ModelSpec.decoder` of dsv4 (models/dsv4/__init__.py), driven through the `Decoder` protocol
(models/decoding.py, inference/generate.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from titan_thd.models.decoding import last_rows, packed_meta
from titan_thd.models.dsv4.attention import Attention
from titan_thd.models.dsv4.model import DSv4Model
from titan_thd.models.dsv4.plans import BatchPlan, CompressPlan, rope_dtype
from titan_thd.models.dsv4.rope import apply_rope, cos_sin, inv_freq


@dataclass
class _Cache:
    """One sequence's state in one attention layer."""

    kv_WD: torch.Tensor
    """The K=V rows of its last W-1 positions (fewer at the start)."""
    x_MD: torch.Tensor | None = None
    """Compressed layers: the attention inputs of its last 2m positions."""
    ent_CD: torch.Tensor | None = None
    """Compressed layers: the entries of its complete windows."""
    ient_CI: torch.Tensor | None = None
    """CSA layers: the indexer's entries of the same windows."""


@dataclass
class _Visible:
    """What Indexer.select reads of a CompressPlan: each query's first entry and visible count."""

    start_T: torch.Tensor
    n_vis_T: torch.Tensor


def _pad_rows(starts: list[int], counts: list[int], width: int, device: torch.device) -> torch.Tensor:
    """[N, width] rows start_i .. start_i + count_i - 1 of each query, -1 after."""
    slot = torch.arange(width, device=device)
    start_N1 = torch.tensor(starts, dtype=torch.int64, device=device)[:, None]
    count_N1 = torch.tensor(counts, dtype=torch.int64, device=device)[:, None]
    return torch.where(slot < count_N1, start_N1 + slot, -1)


class DSv4Decoder:
    def __init__(self, model: DSv4Model, device: torch.device):
        assert model.head is not None and hasattr(model, "embed"), "a whole model, not a pipeline stage"
        self.model, self.device, self.args = model, device, model.args
        self.attns: list[Attention] = [block.attn for block in model.layers.values()]
        self.cache: list[list[_Cache]] = []
        self.pos: list[int] = []

    # ------------------------------------------------------------------ prefill
    def prefill(self, prompts: Sequence[Sequence[int]], room: int) -> torch.Tensor:
        lengths = [len(p) for p in prompts]
        tokens_T = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=self.device)
        seen: list[tuple[torch.Tensor, BatchPlan]] = []
        hooks = [
            attn.register_forward_pre_hook(lambda _, a: seen.append((a[0], a[1]))) for attn in self.attns
        ]
        try:
            logits_TV = self.model(tokens_T, packed_meta(lengths, tokens_T)).logits
        finally:
            for h in hooks:
                h.remove()
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        self.cache = [self._layer_cache(attn, x, plan, starts) for attn, (x, plan) in zip(self.attns, seen)]
        self.pos = lengths
        return logits_TV[last_rows(lengths).to(self.device)]

    def _layer_cache(self, attn: Attention, x_TD: torch.Tensor, plan: BatchPlan, starts: list[int]):
        W, out = self.args.window, []
        rope_k, _ = plan.rope(attn.layer_type)
        ent = ient = None
        if attn.compressor is not None:
            cplan = plan.compress[attn.layer_type]
            ent = attn.compressor(x_TD, cplan)
            if attn.indexer is not None:
                ient = attn.indexer.compressor(x_TD, cplan)
            m = attn.compressor.ratio
        e0 = 0
        for s, e in zip(starts[:-1], starts[1:]):
            rows = slice(max(s, e - (W - 1)), e)
            kv = apply_rope(attn.kv_norm(attn.wkv(x_TD[rows])), rope_k[0][rows], rope_k[1][rows])
            c = _Cache(kv)
            if ent is not None:
                n = (e - s) // m
                c.x_MD = x_TD[max(s, e - 2 * m) : e]
                c.ent_CD = ent[e0 : e0 + n]
                c.ient_CI = None if ient is None else ient[e0 : e0 + n]
                e0 += n
            out.append(c)
        assert ent is None or e0 == ent.shape[0], (e0, ent.shape)
        return out

    # ------------------------------------------------------------------ decode
    def step(self, tokens_N: torch.Tensor) -> torch.Tensor:
        model, args = self.model, self.args
        pos_N = torch.tensor(self.pos, dtype=torch.int64, device=self.device)
        h_NnD = model.embed(tokens_N)[:, None, :].expand(-1, args.hc_mult, -1).contiguous()  # as in DSv4Model
        real_N = torch.ones_like(tokens_N, dtype=torch.bool)
        rdt = rope_dtype(h_NnD.dtype)
        # The new rows' RoPE: rope_theta in sliding layers, the compressed layers' theta (+ YaRN) in others.
        ropes = {compressed: cos_sin(pos_N, inv_freq(args, compressed, rdt)) for compressed in (False, True)}
        for block, cache in zip(model.layers.values(), self.cache, strict=True):
            x_ND, post_Nn, comb_Nnn = block.hc_attn(h_NnD)
            rope = ropes[block.attn.layer_type != "sliding"]
            y_ND = self._attention(block.attn, block.attn_norm(x_ND), cache, rope)
            h_NnD = block.hc_post(y_ND, h_NnD, post_Nn, comb_Nnn)
            x_ND, post_Nn, comb_Nnn = block.hc_ffn(h_NnD)
            y_ND = block.ffn(block.ffn_norm(x_ND), tokens_N, real_N)
            h_NnD = block.hc_post(y_ND, h_NnD, post_Nn, comb_Nnn)
        self.pos = [p + 1 for p in self.pos]
        return model.head(model.norm(model.hc_head(h_NnD)))

    def _attention(
        self,
        attn: Attention,
        x_ND: torch.Tensor,
        cache: list[_Cache],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Attention.forward for one new row per sequence, against the cache (which it updates)."""
        N, W = x_ND.shape[0], self.args.window
        cq_NQ = attn.q_norm(attn.wq_a(x_ND))
        q_NHD, kv_ND = attn.up_proj(cq_NQ, x_ND, rope, rope)  # the new rows are both queries and keys
        windows = [torch.cat([c.kv_WD, kv_ND[i : i + 1]]) for i, c in enumerate(cache)]
        for c, w in zip(cache, windows):
            c.kv_WD = w[max(0, w.shape[0] - (W - 1)) :]
        counts = [w.shape[0] for w in windows]
        rows = [0, *torch.tensor(counts).cumsum(0).tolist()]
        idx_NK = _pad_rows(rows[:-1], counts, W, self.device)
        if attn.compressor is None:
            return attn.attend(q_NHD, torch.cat(windows), idx_NK, None, rope)[0]

        self._extend_entries(attn, x_ND, cache)
        n_ent = [c.ent_CD.shape[0] for c in cache]
        first = [rows[-1], *(rows[-1] + torch.tensor(n_ent).cumsum(0)).tolist()]
        kv_SD = torch.cat(windows + [c.ent_CD for c in cache])
        if attn.indexer is None:  # HCA: every entry of the sequence
            if max(n_ent):
                idx_NK = torch.cat([idx_NK, _pad_rows(first[:-1], n_ent, max(n_ent), self.device)], 1)
        else:  # CSA: the indexer's top-k of the sequence's entries
            ind = attn.indexer
            q_NHI = apply_rope(ind.wq_b(cq_NQ).view(N, ind.n_heads, ind.head_dim), *rope)
            w_NH = ind.weights_proj(x_ND) * ind.n_heads**-0.5
            k_CI = torch.cat([c.ient_CI for c in cache])
            offsets = [f - rows[-1] for f in first[:-1]]
            visible = _Visible(
                torch.tensor(offsets, device=self.device), torch.tensor(n_ent, device=self.device)
            )
            entries_Nk = ind.select(q_NHI, w_NH, k_CI, visible)
            idx_NK = torch.cat([idx_NK, torch.where(entries_Nk >= 0, entries_Nk + rows[-1], -1)], 1)
        return attn.attend(q_NHD, kv_SD, idx_NK, None, rope)[0]

    def _extend_entries(self, attn: Attention, x_ND: torch.Tensor, cache: list[_Cache]) -> None:
        """Remember the new rows' attention inputs; form the entry of every window they complete."""
        m, overlap = attn.compressor.ratio, attn.compressor.overlap
        done = []
        for i, (c, p) in enumerate(zip(cache, self.pos, strict=True)):
            c.x_MD = torch.cat([c.x_MD, x_ND[i : i + 1]])[-2 * m :]
            if (p + 1) % m == 0:
                done.append(i)
        if not done:
            return
        bufs = [cache[i].x_MD for i in done]
        first = [0, *torch.tensor([b.shape[0] for b in bufs]).cumsum(0).tolist()]
        own_CM = torch.tensor([f + b.shape[0] - m for f, b in zip(first, bufs)], device=self.device)[:, None]
        own_CM = own_CM + torch.arange(m, device=self.device)
        w_C = torch.tensor([(self.pos[i] + 1) // m - 1 for i in done], device=self.device)
        prev_CM = torch.where((w_C > 0)[:, None], own_CM - m, -1) if overlap else None
        cos_CR, sin_CR = cos_sin(w_C * m, inv_freq(self.args, True, rope_dtype(x_ND.dtype)))
        plan = CompressPlan(
            ratio=m,
            own_CM=own_CM,
            prev_CM=prev_CM,
            pos_C=w_C * m,
            start_T=w_C.new_zeros(0),
            n_vis_T=w_C.new_zeros(0),
            max_entries=0,
            cos_CR=cos_CR,
            sin_CR=sin_CR,
            num_entries=len(done),
        )
        x_RD = torch.cat(bufs)
        ent_CD = attn.compressor(x_RD, plan)
        ient_CI = attn.indexer.compressor(x_RD, plan) if attn.indexer is not None else None
        for j, i in enumerate(done):
            c = cache[i]
            c.ent_CD = torch.cat([c.ent_CD, ent_CD[j : j + 1]])
            if ient_CI is not None:
                c.ient_CI = torch.cat([c.ient_CI, ient_CI[j : j + 1]])

    def keep(self, index: list[int]) -> None:
        self.cache = [[layer[i] for i in index] for layer in self.cache]
        self.pos = [self.pos[i] for i in index]
