"""The parts of the streaming benchmark (``benchmarks.bench_spark``, ``benchmarks.bench_spark_cpu``).

- ``impl``: what an implementation is (``Impl``, ``RunContext``, the source and output schemas);
- ``processors``: the row and pandas running-count processors and the processing-time session
  processor (Spark's workers import them);
- ``peers``: Spark's own implementations; ``ours``: ours, through ``spark_integration``;
  ``registry``: every implementation by name;
- ``data``: the input files, their expected output and the check of a run's output;
- ``session``: the SparkSession of a job and the machine's description;
- ``sink``: the checksum sink every run writes to;
- ``cpu``: CPU accounting from ``/proc`` (the machine is shared);
- ``worker``: one job in a fresh process; ``runner``: the driver that starts the workers;
- ``throughput``, ``sessions`` (processing-time timers, batches without input) and ``restart``:
  the three scenarios; ``report``: tables and plot.

Imports nothing here: Spark's Python workers import ``processors`` through this package.
"""
