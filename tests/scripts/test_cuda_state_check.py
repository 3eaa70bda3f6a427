"""The in-vLLM state check's comparison (scripts/cuda_state_check.py) on
engine results as they come back from their processes: through JSON."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cuda_state_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("cuda_state_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_sees_logprob_differences_after_json(tmp_path):
    """JSON turns the log-probabilities' token ids into strings; read back,
    a difference of 0.2 at the second token must show, not read as 0."""
    check = _script()
    ref = {"tokens": [[1, 2, 3]], "logprobs": [[{1: -0.1, 5: -3.0}, {2: -0.1, 5: -3.0}, {3: -0.2, 6: -2.0}]]}
    got = {"tokens": [[1, 2, 3]], "logprobs": [[{1: -0.1, 5: -3.0}, {2: -0.3, 5: -3.0}, {3: -0.2, 6: -2.0}]]}
    for name, res in (("ref", ref), ("got", got)):
        (tmp_path / f"{name}.json").write_text(json.dumps(res))
    out = check.compare(check.read_result(tmp_path / "got.json"), check.read_result(tmp_path / "ref.json"))
    assert out["tokens_compared"] == 3 and out["whole_sequences_equal"] == 1
    assert abs(out["dlogprob_max"] - 0.2) < 1e-9
    assert abs(out["dlogprob_mean"] - 0.2 / 3) < 1e-9
