"""Wiring fastlazy together, once, when the package is imported.

Everything that connects one module to another happens here, in one
function, rather than as side effects of importing modules: the compiled
core gets the Python functions it calls up into (one Hooks object), the op
table's rows are declared to it, LazyTensor gets its methods, the graph
cache its backend, and the environment variables take effect.
"""
from __future__ import annotations

import atexit
import functools
import os

from fastlazy import (_core, autograd_calls, backends, capture, compile_process, compile_worker,
                      cpu_pool, detached_writes, failures, fx_threads, generic, graph_cache,
                      host_checks, inference_saves, layouts, lazy_device, leaves, metrics,
                      mutation, optable, python_bodies, random_ops, recompiles, route,
                      running_stats, sites, step_executor, tensor_methods, tiering, views, watch)
from fastlazy.backends import inductor

_booted = False


def hooks() -> _core.Hooks:
    """The Python side of every call the core makes up into Python."""
    return _core.Hooks(
        record_call=route.call,
        run_eagerly=route.run_eagerly,
        tensor_to=tensor_methods.lazy_to,
        check_leaf=views.check_leaf,
        check_write=views.check_write,
        after_mutation=mutation.after_mutation,
        succeed_leaf=leaves.succeed,
        check_saved_inference=inference_saves.check_saved,
        compile_and_run=graph_cache.compile_and_run,
        recover=graph_cache.recover,
        programs=graph_cache.programs,
        forget_signatures=generic.forget_signatures,
        graph_failed=functools.partial(failures.graph_failed, backends.get("eager")),
        site_of_call=sites.site_of_call,
        pending_strides=layouts.pending_strides,
        lay_out_as_eager=mutation.lay_out_as_eager,
        run_body=python_bodies.run_body,
        unsafe=capture.Unsafe,
        atoms=generic.ATOMS,
        backward_scope=cpu_pool.scope,
    )


def boot() -> None:
    global _booted
    if _booted:
        return
    _core.install(hooks())
    _core.set_tensor_reader(step_executor.tensor_reader())
    cpu_pool.configure()
    running_stats.install()
    _core.set_dropout_draws(random_ops.draws_plainly)
    _core.set_generic_layouts(layouts.generic_keeps_contiguous, layouts.generic_follows_operands)
    metrics.count_flush_sites()
    optable.register(_core.register_op)
    host_checks.define()
    detached_writes.define()
    tensor_methods.install_lazy_tensor_methods()
    metrics.tier_listing, metrics.tier_summary = graph_cache.tiers, graph_cache.tier_summary
    metrics.fusion_listing = graph_cache.fusion
    autograd_calls.on_create_graph = _keep_training_graphs_fast
    autograd_calls.on_intermediate_inputs = _keep_training_graphs_fast_for_intermediates
    watch.on_swap = tiering.forget_parameters
    graph_cache.set_backend(backends.default_name())
    lazy_device.install()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork)
    compile_worker.at_close(compile_process.close)
    atexit.register(compile_process.close)
    _configure_from_environment()
    _booted = True


def _keep_training_graphs_fast():
    tiering.keep_training_graphs_fast(list(graph_cache.programs.values()))


def _keep_training_graphs_fast_for_intermediates():
    tiering.keep_training_graphs_fast(list(graph_cache.programs.values()),
                                      tiering.INTERMEDIATES_DIFFERENTIATED)


def _after_fork():
    """In a forked child only the forking thread exists: the compile thread,
    the parent's compile process and every lock they held stay behind."""
    compile_worker.forget_after_fork()
    compile_process.forget_after_fork()
    tiering.forget_compiles_after_fork(list(graph_cache.programs.values()))
    inductor.new_lock_after_fork()
    fx_threads.new_lock_after_fork()
    cpu_pool.after_fork()


def _configure_from_environment():
    if os.environ.get("FASTLAZY_SYNC") == "1":
        # every op runs at its call, node by node: bisect a wrong result
        graph_cache.set_backend("eager")
        _core.set_flush_threshold(1)
    if os.environ.get("FASTLAZY_SITES") == "1":
        # every node keeps the line that recorded it (about 1 µs per op):
        # errors raised when a value is read name it
        _core.set_record_sites(True)
    warn_after = int(os.environ.get("FASTLAZY_WARN_RECOMPILES", "0") or 0)
    if warn_after:
        recompiles.warn_after = warn_after
        _core.set_record_sites(True)
    if os.environ.get("FASTLAZY_METRICS") == "1":
        atexit.register(lambda: print(metrics.report()))
