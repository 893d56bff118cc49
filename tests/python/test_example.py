"""examples/python/train_gpt.py runs as docs/python.md shows: a progress line per step and a
validation loss below the corpus' unigram entropy, with the optimizer states on NVMe."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "python" / "train_gpt.py"


def test_train_gpt_learns_the_corpus_with_states_on_nvme(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "80", "--offload", "nvme",
         "--nvme-path", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    steps = re.findall(r"^step +(\d+) +loss ([\d.]+) .* nvme r ([\d.]+)MiB w ([\d.]+)MiB$",
                       result.stdout, re.MULTILINE)
    assert [int(s[0]) for s in steps] == list(range(1, 81))
    # Every step read and wrote the states (0.84M parameters x 12 bytes = 9.6 MiB) on NVMe; a
    # step's writes may finish during the next one, so the mean is what is exact.
    for column in (2, 3):
        assert sum(float(s[column]) for s in steps) / len(steps) > 9.0
    assert float(steps[-1][1]) < float(steps[0][1]) - 2.0
    assert "below the corpus' unigram entropy" in result.stdout


def test_train_gpt_learns_with_its_parameters_on_nvme_in_a_third_of_their_memory(tmp_path):
    """--offload-params nvme: 0.84M parameters (3.4 MiB, 6.7 MiB with gradients) trained with
    2 MiB of device memory."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "80", "--offload", "nvme", "--nvme-path",
         str(tmp_path), "--offload-params", "nvme", "--device-memory", "2MiB",
         "--chunk-size", "256KiB"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    peak, budget, fetched = map(float, re.search(
        r"device peak ([\d.]+) MiB of ([\d.]+) MiB; fetched ([\d.]+) MiB per step",
        result.stdout).groups())
    assert budget == 2.0 and 0 < peak <= budget
    assert fetched > 3.4  # At least the parameters once per step (forward and backward: twice).
    assert "below the corpus' unigram entropy" in result.stdout
