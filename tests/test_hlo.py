"""Reading collectives from HLO text, on lines in each replica-group format XLA prints."""

from jddp.hlo import collectives, ring_bytes, total_bytes

HLO = """
  %a = f32[1024,256]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%r
  %b = (f32[], f32[10]{0}, /*index=2*/f32[3]{0}) all-reduce(%s, %t, /*index=2*/%u), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}
  %c = f32[128,256]{1,0} reduce-scatter(%g), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}
  %d = f32[64,32]{1,0} all-gather(%p), channel_id=4, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}
  %e = f32[] all-reduce(%l), channel_id=5, replica_groups=mesh['axis_0'=4,'axis_1'=2], to_apply=%r
"""  # noqa: E501


def test_kinds_sizes_and_group_sizes():
    assert collectives(HLO) == [
        ("all-reduce", [1024 * 256 * 4], 8),
        ("all-reduce", [4, 40, 12], 2),
        ("reduce-scatter", [128 * 256 * 4], 4),
        ("all-gather", [64 * 32 * 4], 4),
        ("all-reduce", [4], 8),
    ]


def test_totals_skip_scalars_and_ring_bytes_follow_the_paper():
    ops = collectives(HLO)
    assert total_bytes(ops, "all-reduce") == 1024 * 256 * 4 + 40 + 12
    assert ring_bytes(ops) == 2 * (1024 * 256 * 4 + 52) + 4 * 128 * 256 * 4 + 64 * 32 * 4
