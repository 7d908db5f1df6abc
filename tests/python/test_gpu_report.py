"""The GPU tier's figures in the guide are the committed results' (benchmarks/gpu_report.py)."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_report  # noqa: E402


def test_the_guide_shows_the_committed_gpu_results():
    got = gpu_report.section(gpu_report.GUIDE.read_text())
    assert got is not None, "the guide lost its generated section's markers"
    assert got == gpu_report.render(), "run: python3 benchmarks/gpu_report.py (the GPU results changed)"


def test_the_report_reads_every_file_kind(tmp_path):
    """Each kind of result the tier writes shows up with its numbers (an independent small set)."""
    dev = "Some_GPU"
    (tmp_path / f"test_gpu_{dev}.txt").write_text("....\n==== 3 passed, 1 skipped in 2.50s ====\n")
    (tmp_path / f"host_syncs_{dev}.json").write_text(json.dumps({"per_step": {"cudaStreamSynchronize": 2.0}}))
    (tmp_path / f"throughput_{dev}.json").write_text(json.dumps(
        {"config": {"hidden": 8}, "rows": {"device_adam": {"tokens_per_s": 1234.0, "mfu": 0.5, "step_s": 0.25,
                                                          "optimizer_s": 0.125}}}))
    (tmp_path / f"plan_gpu_{dev}.json").write_text(json.dumps(
        {"rows": {"wide": {"predicted_s": 1.0, "measured_s": 2.0, "error": -0.5, "memory_error": 0.25}}}))
    text = gpu_report.render(tmp_path)
    assert "**Some GPU**" in text and "3 passed, 1 skipped" in text
    assert "cudaStreamSynchronize 2.0" in text and "1,234 tokens/s, MFU 50.0%" in text
    assert "wide 1.000 s vs 2.000 s (-50%), memory +25%" in text
