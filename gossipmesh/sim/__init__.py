"""A simulator of large meshes: the real averaging algorithms on a virtual network, in virtual time.

``sim.clock`` schedules the nodes, ``sim.network`` is the peer interface with latency, bandwidth,
loss, partitions and crashes, ``sim.scenario`` says what to simulate, ``sim.run`` runs it,
``sim.allreduce`` is the ring-allreduce reference and ``sim.training`` a real-task workload.
"""
