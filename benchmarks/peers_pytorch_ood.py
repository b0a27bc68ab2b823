"""pytorch-ood's ``Mahalanobis`` detector on the inputs ``ood.py`` saved; run under the peers' Python.

Reads ``{"inputs": path, "budget_s": s}`` as JSON on stdin, prints one JSON line: seconds per
``predict_features`` call per (D, B), the largest relative difference of twice its score (it
reports half the squared distance) from torch_kernels' score, and its fit time.
"""

import json
import sys

import torch
from pytorch_ood.detector import Mahalanobis

from common import seconds_per_call


def main() -> None:
    request = json.loads(sys.stdin.read())
    inputs = torch.load(request["inputs"])
    answer = {"version": __import__("pytorch_ood").__version__, "torch": torch.__version__, "score": [], "fit": None}
    for case in inputs["score"]:
        detector = Mahalanobis(None)
        detector.mu = case["mean"][None]
        detector.precision = case["precision"]
        for b, x, expected in zip(case["batch_sizes"], case["x"], case["expected"]):
            got = 2 * detector.predict_features(x)
            difference = ((got - expected).abs() / expected.abs().clamp(min=1e-6)).max().item()
            seconds = seconds_per_call(lambda: detector.predict_features(x), request["budget_s"])
            answer["score"].append({"d": x.shape[1], "b": b, "seconds": seconds, "max_rel_diff": difference})
    if inputs.get("fit") is not None:
        features = inputs["fit"]
        labels = torch.zeros(len(features), dtype=torch.long)
        answer["fit"] = seconds_per_call(lambda: Mahalanobis(None).fit_features(features, labels), request["budget_s"])
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
