"""The C++ CPU kernels' build (issue 20, case 10): a failed build is never silent (one warning per kernel with
the compiler's reason; `paged-backend info` and the metrics show the PyTorch fallback), and `CXX` may be a
command with arguments (`CXX="ccache g++"`)."""

from __future__ import annotations

import logging
import shutil
import stat

import pytest
import torch

from conftest import get_model, run_to_completion
from paged_backend import LLMEngine, SamplingParams, kernels
from paged_backend.adapters.http.metrics import ServerMetrics
from paged_backend.adapters.triton.custom_metrics import TritonEngineMetrics
from paged_backend.worker.model_info import model_info
from paged_backend.kernels import cpu_build


class FakeTritonMetrics:
    """The part of Triton's `pb_utils` the custom metrics use: families of metrics that record their labels and
    value."""

    class MetricFamily:
        GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
        families = {}

        def __init__(self, name, description, kind):
            self.name, self.metrics = name, []
            FakeTritonMetrics.MetricFamily.families[name] = self

        def Metric(self, labels, buckets=None):  # noqa: N802 - Triton's name
            metric = FakeTritonMetrics.Value(labels)
            self.metrics.append(metric)
            return metric

    class Value:
        def __init__(self, labels):
            self.labels, self.value = labels, 0.0

        def set(self, value):
            self.value = value

        def increment(self, value):
            self.value += value

        def observe(self, value):
            pass


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The kernels are built afresh into an empty cache directory (nothing this process or the machine built
    before is reused); afterwards the normal build state comes back for the tests that follow."""
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGED_BACKEND_KERNELS", raising=False)
    # both caches: the operator libraries too, else a test alone and the same test after another that loaded
    # them see different builds (run alone, this file's metrics test once met a second warning it did not expect)
    cpu_build.load_library.cache_clear()
    cpu_build.load_torch_ops.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    cpu_build.load_library.cache_clear()
    cpu_build.load_torch_ops.cache_clear()
    cpu_build._errors.clear()


def test_a_failed_build_is_logged_once_and_shown_by_info_and_the_metrics(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(fresh_build / "no-such-compiler"))
    model, tok = get_model("tiny-llama", torch.float32)
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine(model, tokenizer=tok, num_blocks=16, block_size=4)
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=3, ignore_eos=True)  # drawn by the sampler
        for rid in "ab":
            engine.add_request(rid, [5, 6, 7], params)
        finals = run_to_completion(engine)
        for _ in range(3):
            assert kernels.kernel_backend(torch.empty(1)) == "torch"
        report = model_info("tiny-llama")
        metrics = ServerMetrics(engine).render().decode()
        TritonEngineMetrics(FakeTritonMetrics, {"model": "m", "version": "1"}).update(engine.get_stats())
    assert all(out.error is None for out in finals.values())
    warnings = [r.getMessage() for r in caplog.records if r.name == "paged_backend.kernels.cpu_build"]
    # each library's failure once, however often it is asked for (the attention kernel's, and the operator
    # libraries' that the engine's kernel report asks for; the sampler's kernel is used only beside the
    # attention's, so it is not built at all)
    assert len(warnings) == len(set(warnings)), "\n".join(warnings)
    assert all("no-such-compiler" in w and "PyTorch" in w for w in warnings), "\n".join(warnings)
    assert any(w.startswith("the C++ kernel cpu_attention cannot be built") for w in warnings), "\n".join(warnings)
    assert not any("cpu_sampler" in w for w in warnings), "\n".join(warnings)
    assert engine.get_stats().kernels == {"attention": "torch", "sampler": "torch", "linear_rows": "torch",
                                          "attend_layer": "python"}
    assert ('paged_backend:kernel_info{attend_layer="python",attention="torch",linear_rows="torch",sampler="torch"} '
            '1.0') in metrics
    [triton] = FakeTritonMetrics.MetricFamily.families["paged_backend:kernel_info"].metrics
    assert (triton.labels, triton.value) == ({"model": "m", "version": "1", "attention": "torch", "sampler": "torch",
                                              "linear_rows": "torch", "attend_layer": "python"}, 1.0)
    lines = report.splitlines()
    assert ("kernels (cpu):      attention torch, sampler torch, compiled linear torch, compiled attention python"
            in lines)
    assert any("cpu_attention not built" in line and "no-such-compiler" in line for line in lines)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ behind the wrapper")
def test_cxx_with_a_wrapper_and_an_argument_is_honoured(fresh_build, monkeypatch):
    """`CXX="<wrapper> g++"`, as `CXX="ccache g++"`: the wrapper runs (it logs its arguments, then execs
    them) and the kernel builds."""
    log = fresh_build / "wrapper.log"
    wrapper = fresh_build / "fake-ccache"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CXX", f"{wrapper} g++")
    assert cpu_build.load_library("cpu_sampler") is not None, cpu_build.build_error("cpu_sampler")
    calls = log.read_text().splitlines()
    assert "g++ --version" in calls
    assert any(call.startswith("g++ -O3") and call.split()[-3].endswith("cpu_sampler.cpp") for call in calls), calls
