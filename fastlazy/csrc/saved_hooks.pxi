# torch.autograd.graph.saved_tensors_hooks, which non-reentrant
# torch.utils.checkpoint and save_on_cpu open around the calls whose saved
# tensors they pack.  A recorded node saves its tensors when its graph runs,
# after such a context has closed (or before, for a graph recorded outside
# and read inside it), so the hooks would see other tensors, in another
# order, than eager's calls give them: checkpoint's recomputation then
# raises CheckpointError.  While a context is open on the calling thread and
# grad mode is on, calls with LazyTensors run eagerly (their saves pass
# through the hooks in eager's order), and a graph computed meanwhile saves
# its tensors past the hooks, as eager's calls recorded before the context
# saved them.

cdef int fl_saved_hooks = 0      # contexts open, over all threads (fastlazy.patching)
cdef object _top_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks
cdef object _push_saved_hooks = torch._C._autograd._push_saved_tensors_default_hooks
cdef object _pop_saved_hooks = torch._C._autograd._pop_saved_tensors_default_hooks


def saved_hooks_entered(int delta):
    global fl_saved_hooks
    fl_saved_hooks += delta
    if fl_saved_hooks < 0:
        fl_saved_hooks = 0


def saved_hooks_depth():
    return fl_saved_hooks


cdef bint hooks_open() except -1:
    """Are saved-tensor hooks open on this thread?"""
    return fl_saved_hooks and _top_saved_hooks(False) is not None


cdef bint saving_through_hooks() except -1:
    """Would a call on this thread now save its tensors through the hooks?"""
    return hooks_open() and grad_enabled()


# Forward-mode AD (torch.autograd.forward_ad): a dual tensor's tangent
# follows the eager calls made inside its dual level; a recorded node runs
# later, without it.  While a level is open (they are process-wide, as
# torch's), calls with LazyTensors run eagerly on their values.
cdef int fl_dual_levels = 0      # forward-AD levels open (fastlazy.patching)


def dual_levels_entered(int delta):
    global fl_dual_levels
    fl_dual_levels += delta
    if fl_dual_levels < 0:
        fl_dual_levels = 0


def dual_levels_depth():
    return fl_dual_levels


cdef object eager_only():
    """Why a call with LazyTensors on this thread must run eagerly now (the
    fallback reason), or None: saved-tensor hooks would see its saves, or a
    forward-AD level would lose its tangents.  Callers test
    `fl_saved_hooks or fl_dual_levels` first, so that no call is made where
    neither is open (the recording path's cost)."""
    if saving_through_hooks():
        return SAVED_HOOKS_OPEN
    if fl_dual_levels:
        return FORWARD_AD_OPEN
    return None


cdef bint eager_only_now() except -1:
    """eager_only as a flag, decided without an object: lazy_call tests it
    (an object it would hold, or one of a function inlined into it, costs
    every recorded op 15-20 ns)."""
    return saving_through_hooks() or fl_dual_levels


def eager_only_reason():
    """eager_only for Python (fastlazy.route, tensor_methods)."""
    return eager_only() if fl_saved_hooks or fl_dual_levels else None


def _unpacked(saved):
    return saved


cdef int push_plain_saves() except -1:
    """Hooks that keep each saved tensor as it is, over the open ones."""
    _push_saved_hooks(_unpacked, _unpacked)
    return 0


cdef int pop_plain_saves() except -1:
    _pop_saved_hooks()
    return 0
