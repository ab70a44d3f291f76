"""The help texts of the `flashlite` command: its description and examples, and each
sub-command's (plain text, line breaks kept; :mod:`flashlite.cli.parser` shows them)."""

DESCRIPTION = """\
Online softmax and tiled attention in Triton: check them against torch, and count the
HBM bytes they move.

Without a CUDA GPU every kernel runs in Triton's interpreter on the CPU: the same kernel
source, slower, no setting needed. Give --device cuda to run compiled on a GPU."""

EXAMPLES = """\
examples:
  flashlite demo                        accuracy checks, traffic table and a plot (CPU)
  flashlite softmax --rows 4 --n 4096 --algorithm online
  flashlite attention --seq 128 --seq-k 256 --causal --json
  flashlite traffic --seq 64 128 256 --count --plot traffic.png
  flashlite traffic --seq 4096 16384 --head-dim 128 --dtype bfloat16 --measure   (GPU + ncu)

Run 'flashlite COMMAND --help' for the options of one command. With --json, results go to
stdout as JSON; notes and progress go to stderr."""

DEMO = """\
A quick tour on the CPU (Triton's interpreter, a few seconds):
  1. softmax (every algorithm) and attention (causal and not) against fp64 references;
  2. the bytes each softmax kernel loads and stores, counted, next to the traffic model;
  3. the same for attention (naive vs flashlite), as a table and a log-log plot.
The plot is written to --out; the command prints its absolute path."""

DEMO_EXAMPLES = """\
examples:
  flashlite demo                        writes ./flashlite-traffic.png
  flashlite demo --out /tmp/traffic.svg"""

SOFTMAX = """\
Run flashlite.softmax (or log_softmax) on a random (rows, n) tensor and print the largest
absolute error against torch computed in fp64, and the time the call took."""

SOFTMAX_EXAMPLES = """\
examples:
  flashlite softmax --rows 4 --n 4096 --algorithm online
  flashlite softmax --log --dtype bfloat16 --json"""

ATTENTION = """\
Run flashlite.attention on random Q, K, V of shape (batch, heads, seq, head-dim) and print
the largest absolute error against flashlite.reference.attention in fp64."""

ATTENTION_EXAMPLES = """\
examples:
  flashlite attention --seq 128 --causal
  flashlite attention --heads 8 --kv-heads 2 --seq 1 --seq-k 300 --json   (GQA, one query)"""

TRAFFIC = """\
HBM bytes of one attention call, per method and sequence length, three ways:
  model     closed-form bytes (always shown);
  counted   bytes of every load and store, running the kernels in Triton's interpreter
            (--count; on a CUDA machine the command re-runs itself with TRITON_INTERPRET=1);
  measured  DRAM bytes from Nsight Compute (--measure; needs a CUDA GPU and ncu).
The last column compares the best available figure with the compulsory bytes (Q, K, V and
O each moved once)."""

TRAFFIC_EXAMPLES = """\
examples:
  flashlite traffic --seq 1024 4096 --head-dim 64                   model only, instant
  flashlite traffic --seq 64 128 256 --causal --count --plot traffic.png
  flashlite traffic --shared-prefix 32768 --seq 1024 --batch 64 --heads 32 --kv-heads 8 \\
      --head-dim 128 --dtype bfloat16                  the shared step vs prefix copies
  flashlite traffic --mask document_causal --docs 8 --seq 8192 32768 --head-dim 128
  flashlite traffic --seq 4096 16384 --heads 16 --head-dim 128 --dtype bfloat16 --measure"""

BENCH = """\
Print how to run the benchmark scripts in benchmarks/ (they need a GPU and write JSON and
PNG files to benchmarks/results/)."""
