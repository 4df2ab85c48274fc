"""The examples of README.md and the user guide (docs/guide/) that need a live service,
run as written on one service: the README quickstart's ``launch`` block starts it (the
module's only launch), every page's ``service`` blocks use it, the README's ``teardown``
block stops it. How a block is marked: tests/doc_examples.py."""

from __future__ import annotations

import pytest

from torchrl_vllm_ext import WeightSyncScheme

from ..doc_examples import all_examples, pages_with, run_page


@pytest.fixture(scope="module")
def quickstart(ray_cluster, tmp_path_factory):
    """The namespace the README's launch block leaves (``svc``, ``model_path``)."""
    (launch,) = all_examples("launch")
    root = tmp_path_factory.mktemp("guide")
    namespace = {"__name__": "__guide__"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHRL_VLLM_CACHE", str(root / "cache"))  # make_tiny_model() lands here
        mp.chdir(root)  # files an example writes
        try:
            launch.run(namespace)
            yield namespace
            for example in all_examples("teardown"):
                example.run(namespace)
        finally:
            if "svc" in namespace:
                namespace["svc"].shutdown()  # idempotent; after a failed teardown too


@pytest.mark.parametrize("page", pages_with("service"), ids=lambda p: p.name)
def test_examples_run_on_the_live_service(page, quickstart):
    namespace = dict(quickstart)
    try:
        run_page(page, "service", namespace)
    finally:  # an example that failed half-way leaves no slots behind
        for value in namespace.values():
            if isinstance(value, WeightSyncScheme):
                value.close()
