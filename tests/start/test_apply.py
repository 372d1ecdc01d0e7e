"""apply's own checks that need no container."""

import pytest

from oci_gpu_hook.start import apply, plan


def test_every_operation_has_a_handler_in_apply():
    """apply checks at import that each Operation type has a do_<Type>; a new type without one
    is refused."""
    apply.check_handlers()  # the real ones

    class Teleport(plan.Operation):
        __slots__ = ()

    with pytest.raises(ImportError, match="no handler for Teleport"):
        apply.check_handlers([Teleport])
