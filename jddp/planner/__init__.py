"""The cluster planner behind `python -m jddp.plan`: which strategy and mesh, and how fast.

layouts.py    the (strategy, data x fsdp x tensor x stage) layouts to plan for N devices
workload.py   what is trained, as the planner sees it: parameter shapes, FLOPs, a
              transformer's dimensions (from a jddp config, or written out for a paper's run)
collective.py a collective as counted: kind, axes, bytes, count, and the phase it runs in
comm.py       the collectives each layout runs per step, per mesh axis (exact: tested against
              the compiled HLO)
auto.py       what XLA's partitioner gathers or moves under `auto`, and its collectives
network.py    what a collective costs on the links a mesh axis crosses (ring formulas,
              hierarchical across hosts, the bytes each device sends over the data-center
              network) and how long a step waits for the slowest of its hosts
stages.py     the stage axis: micro-batches, bubble, sends per tick, the stage reduction (bytes
              exact against the compiled pipeline)
shards.py     each parameter's layout on a mesh, from the partition rules
memory_model.py  bytes per device: exact state, analytic activations
compiled.py   exact peaks from the compiled step, where it compiles here
timing.py     a step's predicted time: compute, exposed communication per axis, bubble
devices.py    device profiles: datasheet presets with sources, the measured `cpu` profile
              (measured by experiments/calibrate/ in a checkout, not by the library)
published.py  published large-scale runs the planner reproduces
search.py     every layout for a workload, predicted and ranked
"""
