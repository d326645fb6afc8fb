"""Reading collectives from HLO text, on lines in each replica-group format XLA prints."""

import numpy as np

from jddp.observe.hlo import collectives, ring_bytes, total_bytes

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


MESH_AND_LOOP = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %r = f32[8]{0} reduce-scatter(%g), channel_id=3, replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}
}

ENTRY %main (x: f32[32]) -> f32[32] {
  %g = f32[32]{0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %a = f32[16]{0} all-reduce(%y), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}
}
"""  # noqa: E501


def test_replica_groups_of_every_format_and_loop_trip_counts():
    """Groups read as device ids (the mesh form with a transposed device order included), the
    mesh axes they span, and ops inside a loop counted once per trip."""
    from jddp.observe.hlo import bytes_by_axes, collective_ops, replica_groups

    assert replica_groups("replica_groups=[2,4]<=[8], x") == ((0, 1, 2, 3), (4, 5, 6, 7))
    # iota(8) as (4, 2), transposed to (2, 4), read as groups of 2: (0, 2), (4, 6), ...
    assert replica_groups("replica_groups=[4,2]<=[4,2]T(1,0), x")[:2] == ((0, 2), (4, 6))
    # devices ordered (2, 4) transposed: the mesh is [[0, 4], [1, 5], [2, 6], [3, 7]]
    text = "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
    assert replica_groups(text) == ((0, 1, 2, 3), (4, 5, 6, 7))
    ops = collective_ops(MESH_AND_LOOP)
    assert [(op.kind, op.executions) for op in ops] == [
        ("reduce-scatter", 3),
        ("all-gather", 1),
        ("all-reduce", 1),
    ]
    mesh = np.arange(8).reshape(2, 4)  # a data:2 x fsdp:4 mesh, fsdp fastest
    assert bytes_by_axes(ops, mesh, ["data", "fsdp"]) == {
        (("fsdp",), "reduce-scatter"): 3 * 32,
        (("fsdp",), "all-gather"): 128,
        (("data",), "all-reduce"): 64,
    }


TRAFFIC = """
%fused_scale (p0: f32[64,32], p1: f32[32]) -> f32[64,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %p1 = f32[32]{0} parameter(1)
  %b = f32[64,32]{1,0} broadcast(%p1), dimensions={1}
  ROOT %m = f32[64,32]{1,0} multiply(%p0, %b)
}

%fused_dot (q0: f32[64,32], q1: f32[32,16]) -> f32[64,16] {
  %q0 = f32[64,32]{1,0} parameter(0)
  %q1 = f32[32,16]{1,0} parameter(1)
  ROOT %d = f32[64,16]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], f32[64,32])) -> (s32[], f32[64,32]) {
  %t = (s32[], f32[64,32]{1,0}) parameter(0)
  %v = f32[64,32]{1,0} get-tuple-element(%t), index=1
  %twice = f32[64,32]{1,0} add(%v, %v)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %next = (s32[], f32[64,32]{1,0}) tuple(%i, %twice)
}

ENTRY %main (x: f32[64,32], s: f32[32], w: f32[32,16]) -> f32[64,16] {
  %x = f32[64,32]{1,0} parameter(0)
  %s = f32[32]{0} parameter(1)
  %w = f32[32,16]{1,0} parameter(2)
  %n = f32[64,32]{1,0} fusion(%x, %s), kind=kLoop, calls=%fused_scale
  %h = f32[64,16]{1,0} fusion(%n, %w), kind=kCustom, calls=%fused_dot
  %plain = f32[64,16]{1,0} dot(%n, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %r = f32[64,16]{1,0} all-reduce(%h), channel_id=1, replica_groups={{0,1}}, to_apply=%sum
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,32]{1,0}) tuple(%zero, %n)
  %loop = (s32[], f32[64,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[64,16]{1,0} copy(%r)
}
"""  # noqa: E501


def test_memory_traffic_counts_non_matmul_ops_and_loop_trips():
    """By hand: the scale fusion reads 64 x 32 and 32 floats and writes 64 x 32; the loop body's
    add reads its operand twice and writes once, 3 trips; the copy reads and writes 64 x 16.
    The dots (fused or not), the all-reduce, parameters, tuples and constants move nothing."""
    from jddp.observe.hlo import memory_traffic

    scale = 4 * (64 * 32 + 32 + 64 * 32)
    loop = 3 * 4 * 3 * 64 * 32
    copy = 4 * 2 * 64 * 16
    assert memory_traffic(TRAFFIC) == scale + loop + copy


def test_memory_traffic_of_compiled_programs():
    """What XLA:CPU compiles: an elementwise product of two float32[4096] reads both and
    writes one; a matmul moves nothing the planner counts as memory traffic."""
    import jax
    import jax.numpy as jnp

    from jddp.observe.hlo import memory_traffic

    vector = jax.ShapeDtypeStruct((4096,), jnp.float32)
    product = jax.jit(lambda a, b: a * b).lower(vector, vector).compile().as_text()
    assert memory_traffic(product) == 3 * 4096 * 4
    square = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    matmul = jax.jit(lambda a, b: a @ b).lower(square, square).compile().as_text()
    assert memory_traffic(matmul) == 0
