"""RowRule: the row counts of one layout, by hand-worked numbers, and the start-up refusals it makes."""

from __future__ import annotations

import pytest

from titan_thd.config import load_config
from titan_thd.data.rows import RowRule, full_rows, row_rule
from titan_thd.startup import resolve_run


def test_worked_rules():
    # The crash this rule was made for: dsv4 tiny's halo of 32 under contiguous CP 4; 3 short documents
    # take 92 rows, but every CP rank needs 32: 128 rows.
    dsv4 = row_rule(
        T=2048, pad_to_multiple=1, cp=4, cp_mode="contiguous", tp=1, fixed=False, min_tokens_per_cp_rank=32
    )
    assert (dsv4.multiple, dsv4.minimum) == (4, 128)
    assert [dsv4.rows(u) for u in (0, 92, 128, 129, 2047, 2048)] == [128, 128, 128, 132, 2048, 2048]
    # Flash (halo 128) at CP 4 and TP 2: multiples of 8 from 512.
    flash = row_rule(
        T=2048, pad_to_multiple=1, cp=4, cp_mode="contiguous", tp=2, fixed=False, min_tokens_per_cp_rank=128
    )
    assert (flash.multiple, flash.minimum, flash.rows(288)) == (8, 512, 512)
    # Zigzag CP 3 cuts documents into 6 chunks; with TP 2 each rank's rows split in two: lcm(6, 6) = 6.
    zz = row_rule(T=1536, pad_to_multiple=6, cp=3, cp_mode="zigzag", tp=2, fixed=False)
    assert (zz.multiple, zz.minimum, zz.rows(7)) == (6, 6, 12)
    # Without CP a model needs no halo.
    one = row_rule(
        T=64, pad_to_multiple=1, cp=1, cp_mode="contiguous", tp=1, fixed=False, min_tokens_per_cp_rank=32
    )
    assert (one.minimum, one.rows(3)) == (1, 3)
    # Pipeline parallelism: always T.
    pp = row_rule(T=512, pad_to_multiple=4, cp=2, cp_mode="zigzag", tp=1, fixed=True)
    assert pp.rows(0) == pp.rows(300) == 512 and pp.is_legal(512) and not pp.is_legal(256)
    assert full_rows(96).rows(5) == 96


def test_an_offline_pack_multiple_and_the_refusals():
    rule = row_rule(
        T=96, pad_to_multiple=1, cp=2, cp_mode="contiguous", tp=1, fixed=False, min_tokens_per_cp_rank=10
    )
    assert (rule.multiple, rule.minimum) == (2, 20)
    packed = rule.with_multiple(8)  # a pack whose documents are padded to 8
    assert (packed.multiple, packed.minimum, packed.rows(1)) == (8, 24, 24)
    assert all(packed.is_legal(packed.rows(u)) for u in range(97))
    with pytest.raises(
        ValueError,
        match=r"tokens_per_microbatch = 100 .* multiples of 8 from 8 \(documents padded to multiples of 8\); the smallest valid value is 104",
    ):
        row_rule(T=100, pad_to_multiple=1, cp=2, cp_mode="contiguous", tp=1, fixed=False).with_multiple(8)
    with pytest.raises(
        ValueError,
        match=r"tokens_per_microbatch = 96 .*from 128 \(the model needs 32 rows on each of the 4 CP ranks\).*128",
    ):
        row_rule(
            T=96, pad_to_multiple=1, cp=4, cp_mode="contiguous", tp=1, fixed=False, min_tokens_per_cp_rank=32
        )
    assert RowRule(96, 8, 8, False).rows(9) == 16


def test_start_up_and_the_loader_share_the_rule(tmp_path):
    """`resolve_run` refuses a T that the loader's rule could not hold, with the numbers."""
    base = ["--model.name", "dsv4", "--model.flavor", "micro", "--job.dump_folder", str(tmp_path)]
    cfg = load_config(
        [*base, "--training.tokens_per_microbatch", "256", "--parallelism.context_parallel_degree", "4"]
    )
    run = resolve_run(cfg, 4)
    args, rule = run.model_args, run.rule
    assert (rule.multiple, rule.minimum, rule.fixed) == (4, 4 * args.halo, False)
    assert run.layout(0).rule is rule  # the loader cuts by the rule start-up checked
    cfg = load_config(
        [*base, "--training.tokens_per_microbatch", "256", "--parallelism.pipeline_parallel_degree", "2"]
    )
    assert resolve_run(cfg, 2).rule.fixed  # pipeline stages exchange fixed shapes
