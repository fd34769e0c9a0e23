"""What the benchmarks share: measured child processes, the trees compared, checkpoints, the
page cache, paced servers and the tables. Plain functions over plain data; no benchmark logic."""
