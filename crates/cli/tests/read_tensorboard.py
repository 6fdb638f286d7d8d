"""Prints, as JSON, what TensorBoard's own reader finds in a run's tb/:
{"scalars": {tag: [[step, value], ...]}, "texts": [[step, text], ...]}.
Used by the CLI tests (tests/cli/logs.rs)."""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
tags = acc.Tags()
scalars = {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]}
texts = [
    [e.step, e.tensor_proto.string_val[0].decode()]
    for t in tags["tensors"]
    for e in acc.Tensors(t)
]
print(json.dumps({"scalars": scalars, "texts": texts}))
