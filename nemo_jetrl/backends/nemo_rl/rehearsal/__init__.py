"""``jetrl rehearse``: the launch of ``jetrl train --backend nemo-rl`` run on this machine's CPU.

NeMo-RL's own objects run wherever they run on CPU (Ray, ``RayVirtualCluster``,
``RayWorkerGroup``, ``VllmGeneration`` and its Ray actors on vLLM's CPU build, our plugins and
engine check in them); what needs a GPU is replaced, narrowly and by name, in `cpu_worker`
(docs/rehearsal.md lists every substitute, the real call it replaces, and the test that fails
if it drifts from NeMo-RL's).
"""
