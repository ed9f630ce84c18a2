"""The client side of a job, one module per step, in the order they run.

:mod:`~mgpu.client.plan` checks the jobs and makes their workloads;
:mod:`~mgpu.client.submit` places the panels and tiles on the workers;
:mod:`~mgpu.client.watch` names what a watcher is told (progress, lost workers);
:mod:`~mgpu.client.recover` resubmits the tiles of a lost worker;
:mod:`~mgpu.client.assemble` checks the answer, commits the outputs and builds the Result;
:mod:`~mgpu.client.run` runs those steps for each job on one cluster.

Nothing here names a workload: each is reached through the registry.
"""
