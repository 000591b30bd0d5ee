"""An emulated multi-node cluster on one Linux machine: FCP against Transformer Engine's schedules, measured.

Every rank runs in its own network namespace; intra- and inter-node links are veth pairs through
bridges, shaped with ``tc``; the ranks talk real ``torch.distributed`` gloo (Note [Emulated
cluster] in :mod:`.spec`). The executor runs for real, the GPU kernel is a calibrated sleep
(:mod:`.sleep_kernel`). Modules, one job each::

    spec          rates, ClusterSpec, address plan, the cluster as a Topology, time scale (pure)
    netns         bring-up and teardown of the namespaces (root, ip, tc)
    sleep_kernel  the block kernel that sleeps for the modelled GPU time
    te_ring       Transformer Engine's p2p ring on our transports and kernels (te-p2p)
    workloads     te-p2p, te-a2a-p2p, fcp-<graph>, fcp-auto, fcp-hp: plans, predictions, lower bounds
    runners       one rank's forward + backward of a workload (overlapped, comm-only, compute-only)
    worker        one rank's process: rendezvous, alternating timed runs, JSON
    launcher      one process per rank inside its namespace; progress; always reaps
    bench         the whole benchmark: predictions, cluster, launch, results
    report        the table, the JSON entries and the plot

``megatron-fcp bench --emulate ...`` is the command (:mod:`megatron_fcp.commands.bench`).
Submodules are imported on use (``torch`` only where a rank runs).
"""
