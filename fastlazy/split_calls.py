"""A call of more tensors than one node reads (MAX_IN), recorded as its aten
program cut into parts that each read at most that many.

A node reads at most MAX_IN tensors (`_core.Node.inputs`), and a call run
eagerly instead ends the pending graph at every call: a two-layer
bidirectional `nn.LSTM` or `nn.GRU` (16 weights, its input and its state)
would cut every model around it in two, and a GRU's cells, unrolled over
its steps, would never reach a compiler that fuses them.  Its aten program
is small calls, each of a few tensors (an LSTM's: one `mkldnn_rnn_layer`
per layer and direction, with `select`, `cat` and `stack` around them), so
the program is cut, in its own order, into parts of at most MAX_IN inputs
-- the call's tensors and earlier parts' results --, each part an FX
GraphModule called through an entry point of its own, as any call: its
first call analysed by the generic path, its later ones recorded by the
core from the published signature; its results are the LazyTensors the
later parts read.

A view is recomputed in each part that reads it rather than passed from
one part to the next (a part's result that is a view of an eager argument
is refused by the generic path, as eager's aliasing could not be kept).  A
random call's numbers are drawn as the part that holds it is recorded,
in the program's order, as eager draws them (an RNN's dropout between
layers in training), each one more input of its part.  A program the parts
cannot hold -- a call that writes one of its arguments, or writes in place
across more than MAX_IN inputs, that makes a constant, or one of whose
calls alone reads more than MAX_IN tensors (a `_foreach_` op over a long
list) -- keeps running eagerly, its reason in `fastlazy.explain()`; so
does any such call under autocast, and one whose results view one
another.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.utils._pytree as pytree

from fastlazy import _core, capture
from fastlazy.capture import MAX_INPUTS, Unsafe


class Plan:
    """How one call signature is recorded in parts: `parts`, each an
    entry point (of a GraphModule) and its sources, where a source is an
    argument's position (an int) or (part, result) of an earlier part;
    `results`, a source per leaf of the call's result (None for a None
    leaf); `spec`, the result's pytree spec."""
    __slots__ = ("parts", "results", "spec")

    def __init__(self, parts, results, spec):
        self.parts = parts
        self.results = results
        self.spec = spec


def plan(func, args, kwargs, tensors) -> Plan:
    """The Plan for func(*args, **kwargs) of `tensors` (signature_key's
    order); raises Unsafe where the call cannot be recorded in parts."""
    if _core.autocast_depth():
        # (the program holds autocast's casts, which its parts, recorded
        # under autocast, would be judged for again)
        raise Unsafe(f"more than {MAX_INPUTS} tensor arguments, under autocast (run eagerly)")
    graph, spec, none_leaves = capture.aten_program(func, args, kwargs, tensors)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(tensors):
        raise Unsafe("its aten program makes a constant (run eagerly)")
    for n in graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem:
            _check_call(n)
        elif n.op not in ("placeholder", "output", "call_function"):
            raise Unsafe(f"its aten program holds a {n.op} node (run eagerly)")
    _nest_long_joins(graph)
    outputs = list(graph.nodes)[-1].args[0]
    cut = _Cut(graph, placeholders)
    bases = [cut.base(o) for o in dict.fromkeys(outputs)]
    computed = [b for b in bases if b not in cut.arguments]
    if len(set(computed)) < len(computed):
        # (a part's results are tensors of their own: eager's aliasing
        # between them would be lost)
        raise Unsafe("its results view one another (run eagerly)")
    cut.place_all([n for n in graph.nodes if n.op == "call_function" and n not in cut.views
                   and n.target is not operator.getitem]
                  + [o for o in dict.fromkeys(outputs) if o in cut.views])
    name = getattr(func, "__name__", "call")
    parts = [(_core.make_entry(module, f"{name} (part {k + 1} of {len(cut.parts)})", -1,
                               _core.Form.FORM_CALL), sources)
             for k, (module, sources) in enumerate(cut.modules(outputs))]
    results = iter(cut.source(o) for o in outputs)
    return Plan(parts, [None if none else next(results) for none in none_leaves], spec)


def record(plan: Plan, tensors):
    """The call's result, its parts recorded in order, each called through
    an entry point of its own (the core records a part's later calls from
    its published signature, as any call's)."""
    values = []
    for entry, sources in plan.parts:
        values.append(entry(*[_value(s, tensors, values) for s in sources]))
    flat = [None if s is None else _value(s, tensors, values) for s in plan.results]
    return pytree.tree_unflatten(flat, plan.spec)


def _value(source, tensors, values):
    return tensors[source] if type(source) is int else values[source[0]][source[1]]


def _check_call(node):
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        raise Unsafe(f"its aten program calls {target} (run eagerly)")


_CAT = torch.ops.aten.cat.default
_STACK = torch.ops.aten.stack.default


def _nest_long_joins(graph):
    """Each cat or stack of more than MAX_IN tensors (a GRU's outputs over
    its steps) made a cat of groups of at most MAX_IN: the same copies."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (_CAT, _STACK):
            continue
        seq = node.args[0]
        if len(seq) <= MAX_INPUTS:
            continue
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        with graph.inserting_before(node):
            parts = [graph.call_function(node.target, (list(seq[i:i + MAX_INPUTS]), dim))
                     for i in range(0, len(seq), MAX_INPUTS)]
            while len(parts) > MAX_INPUTS:
                parts = [graph.call_function(_CAT, (parts[i:i + MAX_INPUTS], dim))
                         for i in range(0, len(parts), MAX_INPUTS)]
            joined = graph.call_function(_CAT, (parts, dim))
        node.replace_all_uses_with(joined)
        graph.erase_node(node)


def _draws(node) -> int:
    """The inputs a random call adds to its part: the generic path draws
    its numbers at the call, in the program's order, as eager draws them,
    and hands them to the program (capture.lift_draws)."""
    target = node.target
    return int(isinstance(target, torch._ops.OpOverload)
               and torch.Tag.nondeterministic_seeded in target.tags)


def _written(node):
    """The nodes whose tensors the call `node` writes in place."""
    if node.target is operator.getitem:
        return []
    schema = node.target._schema
    found = []
    for k, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = node.args[k] if k < len(node.args) else node.kwargs.get(a.name)
            torch.fx.node.map_arg(value, found.append)
    return found


def _is_view(node) -> bool:
    """Does the call make a view (and write nothing)?  In-place calls
    return their written argument too, but are calls of their own."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and any(r.alias_info is not None for r in node.target._schema.returns)
            and not any(a.alias_info is not None and a.alias_info.is_write
                        for a in node.target._schema.arguments))


def _one_tensor(node) -> bool:
    """Does node compute one tensor (which a part can hand on)?"""
    if node.op == "placeholder" or node.target is operator.getitem:
        return True
    returns = node.target._schema.returns
    return len(returns) == 1 and isinstance(returns[0].type, torch.TensorType)


def _reads(node):
    """The nodes node's arguments name."""
    found = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


class _Part:
    def __init__(self):
        self.inputs = []        # external nodes, in the order they are read
        self.nodes = []         # the program's nodes computed here, in order
        self.done = set()
        self.draws = 0          # random calls: each draw is one more input


class _Cut:
    """The program's calls assigned to parts in order: a call joins the
    current part where the part's inputs stay within MAX_IN, else the part
    ends and the next one begins -- before that call, or earlier where a
    call between writes in place what one before it computed (a GRU
    cell's sigmoid_ of its gates): a write and the call that made what it
    writes share a part.  A call's `getitem`s go with it, and a view is
    computed (again) in each part that reads it."""

    def __init__(self, graph, placeholders):
        self.arguments = {p: i for i, p in enumerate(placeholders)}
        self.parts = []
        self.views = {n for n in graph.nodes if _is_view(n)}
        # (the views a view of several results makes: unbind's, split's)
        self.views |= {n for n in graph.nodes
                       if n.target is operator.getitem and n.args[0] in self.views}
        self._home = None
        self._exports = None

    def place_all(self, order):
        position = {n: i for i, n in enumerate(order)}
        # a part may not begin at position i where a call at or after i
        # writes what a call before i made
        bound = [0] * (len(order) + 1)
        for i, node in enumerate(order):
            for w in _written(node):
                root = self._root(w)
                if root not in position:
                    raise Unsafe("its aten program writes one of its arguments (run eagerly)")
                bound[position[root] + 1] = max(bound[position[root] + 1], i + 1)
        reach = 0
        for i in range(len(order) + 1):
            reach = max(reach, bound[i])
            bound[i] = reach > i          # True: no part may begin here
        start, i = 0, 0
        part = self._new_part()
        while i < len(order):
            node = order[i]
            if node in part.done:       # (a result that is a view, computed already)
                i += 1
                continue
            needed = self._needs(node, part)
            draws = part.draws + _draws(node)
            if part.nodes and len(set(part.inputs) | needed) + draws > MAX_INPUTS:
                cut = max((j for j in range(start + 1, i + 1) if not bound[j]), default=None)
                if cut is None:
                    raise Unsafe("its aten program writes in place across more than "
                                 f"{MAX_INPUTS} inputs (run eagerly)")
                self.parts.pop()
                part = self._new_part()
                for kept in order[start:cut]:
                    self._compute_with_items(kept, part)
                part = self._new_part()
                start = i = cut
                continue
            if len(needed) + _draws(node) > MAX_INPUTS:
                raise Unsafe(f"its aten call {node.target} alone reads more than {MAX_INPUTS} "
                             "tensors (run eagerly)")
            self._compute_with_items(node, part)
            i += 1
        for part in self.parts:
            for n in part.inputs:
                if not _one_tensor(n):
                    raise Unsafe("its aten program hands a sequence from call to call "
                                 "(run eagerly)")
        self._home = {}
        for k, part in enumerate(self.parts):
            for n in part.nodes:
                self._home.setdefault(n, k)

    def _new_part(self):
        self.parts.append(_Part())
        return self.parts[-1]

    def _compute_with_items(self, node, part):
        self._compute(node, part)
        part.draws += _draws(node)
        for user in node.users:
            if user.target is operator.getitem and user not in self.views:
                self._compute(user, part)

    def base(self, node):
        """The tensor whose view node is (node itself if none)."""
        while node in self.views:
            node = node.args[0]
        return node

    def _root(self, node):
        """The call that made the tensor node is (a view's base's; a
        getitem's call, with which it is computed)."""
        while node in self.views or (node.op == "call_function"
                                     and node.target is operator.getitem):
            node = node.args[0]
        return node

    def _needs(self, node, part):
        """The external nodes `part` must read to compute node."""
        needed = set()
        for a in _reads(node):
            if a in part.done:
                continue
            if a in self.views:
                needed |= self._needs(a, part)
            else:
                needed.add(a)
        return needed

    def _compute(self, node, part):
        for a in _reads(node):
            if a in part.done:
                continue
            if a in self.views:
                self._compute(a, part)
            elif a not in part.inputs:
                part.inputs.append(a)
        part.nodes.append(node)
        part.done.add(node)

    def source(self, node):
        if node in self.arguments:
            return self.arguments[node]
        k = self._home[node]
        return (k, self._exports[k].index(node))

    def modules(self, outputs):
        """(GraphModule, sources) per part, each returning the tuple of
        what later parts and the call's results take from it."""
        self._exports = [[] for _ in self.parts]
        wanted = [n for part in self.parts for n in part.inputs] + [
            o for o in outputs if o not in self.arguments]
        for n in wanted:
            if n not in self.arguments and n not in self._exports[self._home[n]]:
                self._exports[self._home[n]].append(n)
        built = []
        for k, part in enumerate(self.parts):
            graph = torch.fx.Graph()
            env = {n: graph.placeholder(f"in{i}") for i, n in enumerate(part.inputs)}
            for n in part.nodes:
                env[n] = graph.node_copy(n, env.__getitem__)
            graph.output(tuple(env[n] for n in self._exports[k]))
            built.append((torch.fx.GraphModule(torch.nn.Module(), graph),
                          [self.source(n) for n in part.inputs]))
        return built

