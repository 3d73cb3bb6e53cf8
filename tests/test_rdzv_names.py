"""The launcher's cheap replacement for torch elastic's stack-inspecting rendezvous event names
answers what torch's own function answers."""

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from ckptrun.launcher import rdzv_names


def test_same_names_as_torch() -> None:
    torch_own = dynamic_rendezvous.get_method_name
    assert torch_own is not rdzv_names.method_name, "the launcher's replacement is installed in the test process"

    def next_rendezvous() -> list[tuple[str, str]]:
        pairs = []
        for depth in (1, 2, 3):
            pairs.append((torch_own(depth), rdzv_names.method_name(depth)))
        return pairs

    def _record() -> list[tuple[str, str]]:
        return next_rendezvous()

    pairs = _record()
    assert [theirs for theirs, _ in pairs] == ["next_rendezvous", "_record", "test_same_names_as_torch"]
    assert [ours for _, ours in pairs] == [theirs for theirs, _ in pairs]
    assert rdzv_names.method_name(10_000) == torch_own(10_000) == "no_method_name"


def test_installed_by_the_launcher() -> None:
    saved = dynamic_rendezvous.get_method_name
    try:
        rdzv_names.install()
        assert dynamic_rendezvous.get_method_name is rdzv_names.method_name
    finally:
        dynamic_rendezvous.get_method_name = saved
