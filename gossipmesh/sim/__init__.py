"""A simulator of large meshes: the real averaging algorithms on a virtual network, in virtual time.

``clock`` schedules the nodes, ``network`` is the peer interface with latency, bandwidth, loss,
partitions and crashes, ``scenario`` says what to simulate, ``run`` runs it, ``allreduce`` is
the ring-allreduce reference and ``training`` a real-task workload. ``memory`` is the same peer
interface in real time with exact membership: the in-memory network of the tests.
"""
