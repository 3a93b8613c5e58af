"""The TorchScript backend: the graph as TorchScript IR, run by the graph
executor.

With CUDA tensors (or a torch built with LLVM) the profiling executor runs it
and NNC (TensorExpr) fuses the elementwise chains.  On CPU without LLVM (PyPI
wheels) nothing can fuse, so the graph is made cheap to run instead: in-place
aten variants reuse the storage of intermediates nobody else reads, and
fastlazy's step executor (fastlazy.step_executor) runs the IR, calling
ATen's CPU kernels directly where it can; where that executor is not built,
the graph executor's unoptimized plan (no profiling or guard nodes: see
_unoptimized).  (CPU fusion
without LLVM is possible through NNC's IR evaluator, which torch's flags
`_jit_override_can_fuse_on_cpu(True)` and `_jit_set_te_must_use_llvm_cpu(False)`
allow: it interprets the fused loops, far slower than aten's kernels, so it
is for tests of the fusion itself, which `fuses` then reports.)

Each program that may fuse can say what NNC made of it
(`TorchScriptProgram.fusion`): the profiling executor optimizes a graph at
its second run, and its optimized graph holds the fusion groups.
"""
from __future__ import annotations

import operator
import weakref
from typing import NamedTuple

import torch

from fastlazy import metrics, step_executor
from fastlazy.backends.base import (REFS, Backend, Input, Program, Sizes, as_written,
                                    exact_scalars, reusable, run_key, written_form)
from fastlazy.node_program import FLOORDIV, SYM_SIZE

# c10::ScalarType numbering, as TorchScript IR spells a dtype constant.
# tests/test_backends.py checks it against what the tracer emits.
SCALAR_TYPE = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
    torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.complex32: 8,
    torch.complex64: 9, torch.complex128: 10, torch.bool: 11, torch.bfloat16: 15,
}

_TS_TYPES = {"tensor": "Tensor", "int": "int", "float": "float", "complex": "complex"}

# Enums TorchScript passes as ints.
_ENUM_INTS = {
    torch.strided: 0, torch.sparse_coo: 1,
    torch.contiguous_format: 0, torch.preserve_format: 1, torch.channels_last: 2,
    torch.channels_last_3d: 3,
}


def _constant_key(value):
    """What a constant is interned by: its type and value, where 0.0 and
    -0.0 (equal, and the same dict key) are two constants."""
    if type(value) is float and value == 0.0:
        return (float, str(value))
    return (type(value), value)


class _IR:
    """Accumulates IR lines; hands out SSA names and shares constants."""

    def __init__(self):
        self.lines = []
        self.consts = {}
        self.n = 0

    def fresh(self):
        self.n += 1
        return f"%t{self.n}"

    def constant(self, value):
        if isinstance(value, list):
            return self._int_list(value)
        if isinstance(value, tuple):
            return self._int_list(list(value))
        if isinstance(value, torch.dtype):
            value = SCALAR_TYPE[value]
        key = _constant_key(value)
        if key in self.consts:
            return self.consts[key]
        name = self.fresh()
        if value is None:
            self.lines.append(f"  {name} : NoneType = prim::Constant()")
        elif type(value) is bool:
            self.lines.append(f"  {name} : bool = prim::Constant[value={int(value)}]()")
        elif type(value) is int:
            self.lines.append(f"  {name} : int = prim::Constant[value={value}]()")
        elif type(value) is float:
            self.lines.append(f"  {name} : float = prim::Constant[value={value!r}]()")
        elif type(value) is str:
            self.lines.append(f'  {name} : str = prim::Constant[value="{value}"]()')
        else:
            raise TypeError(f"no TorchScript constant for {value!r}")
        self.consts[key] = name
        return name

    def _int_list(self, values):
        return self.list([self.constant(v) for v in values], "int[]")

    def list(self, items, type):
        name = self.fresh()
        self.lines.append(f"  {name} : {type} = prim::ListConstruct({', '.join(items)})")
        return name

    def call(self, op, args, type="Tensor"):
        """`op`: an aten op's name, or another namespace's op qualified."""
        out = self.fresh()
        op = op if "::" in op else "aten::" + op
        self.lines.append(f"  {out} : {type} = {op}({', '.join(args)})")
        return out


class TorchScriptBackend(Backend):
    name = "torchscript"
    # The interpreter's code emitter (torch::jit::interpreter::CodeImpl)
    # emits a value used once at its use, recursively: about 230 bytes of C
    # stack per node of a chain.  A 9,999-node chain overflows a thread's
    # 2 MB stack, a 30,000-node one the main thread's 8 MB; 1,000 needs
    # about 230 KB.
    max_depth = 1000

    def __init__(self):
        self.llvm = torch._C._llvm_enabled()
        if self.llvm:
            torch._C._jit_override_can_fuse_on_cpu(True)

    def compile(self, view) -> Program:
        ir = _IR()
        env = {}
        params = []
        slots = []
        scalars = set()       # SSA names of scalar (non-tensor) inputs
        for s in view.slots:
            if s.kind == "bool":
                env[("slot", s.index)] = _bool_tensor(ir, s.value)
            else:
                name = f"%x{s.index}"
                params.append(f"{name} : {_TS_TYPES[s.kind]}")
                if s.kind != "tensor":
                    scalars.add(name)
                env[("slot", s.index)] = name
                slots.append(s.position)
        fuses = self.fuses(view)
        # writing into intermediates is safe only where autograd keeps none
        reuse = not view.grad and not fuses
        by_index = {n.index: n for n in view.nodes}
        written = as_written(view)
        runs = {}             # base.run_key -> the emitted program's outputs
        for node in view.nodes:
            key = run_key(node)
            if key not in runs:
                program, inplace = written_form(node, written)
                inplace = inplace or reuse and reusable(node, by_index)
                program, inplace = exact_scalars(
                    node, program, inplace, written,
                    lambda k, node=node: env[node.inputs[k]] in scalars)
                runs[key] = _emit(ir, env, node, program, inplace, scalars)
            value = runs[key][node.output]
            if node.cast:
                value = ir.call("to", [value, ir.constant(SCALAR_TYPE[node.dtype]),
                                       ir.constant(False), ir.constant(False), ir.constant(None)])
            env[("node", node.index)] = value
        outs = [env[("node", i)] for i in view.outputs]
        if len(outs) > 1:
            # a function returns one value: several outputs travel as a tuple
            types = ", ".join(["Tensor"] * len(outs))
            ir.lines.append(f"  %outs : ({types}) = prim::TupleConstruct({', '.join(outs)})")
            outs = ["%outs"]
        text = "\n".join([f"graph({', '.join(params)}):", *ir.lines, f"  return ({outs[0]})"])
        fn = _executor_program(text) if not fuses else None
        if fn is None:
            fn = torch._C._create_function_from_graph("fastlazy_graph", torch._C.parse_ir(text))
            if view.grad or not fuses:
                fn = _unoptimized(fn)
        return TorchScriptProgram(slots, fn, len(view.outputs) == 1, text, fuses=fuses,
                                  grad=view.grad)

    def fuses(self, view):
        """Will NNC fuse this graph's elementwise chains?  On CUDA inputs if
        the GPU fuser is on (torch's default); on CPU only where CPU fusion
        was switched on, with LLVM (a torch built with it: __init__ switches
        it on) or with LLVM not required (NNC's IR evaluator)."""
        if not torch._C._jit_texpr_fuser_enabled():
            return False
        if "cuda" in view.device_types:
            can = torch._C._jit_can_fuse_on_gpu()
        else:
            can = torch._C._jit_can_fuse_on_cpu() and (
                self.llvm or not torch._C._jit_get_te_must_use_llvm_cpu())
        # (the complex check reads every node: only where fusion is on)
        return can and not _has_complex(view)


def _has_complex(view) -> bool:
    """Does the graph compute in complex numbers anywhere?  NNC's fusion
    groups take complex values in, then fail at run time ("UNSUPPORTED
    DTYPE: complex"), from the second run on: such a graph is not fused."""
    return (any(s.kind == "complex" or s.kind == "tensor" and s.value.is_complex()
                for s in view.slots)
            or any(n.dtype.is_complex for n in view.nodes))


# the programs compiled to fuse, while they live (fusion_of reads them)
_fusing: weakref.WeakSet = weakref.WeakSet()

# the nodes NNC (TensorExpr) or the legacy fuser makes of fused ops
FUSION_KINDS = frozenset({"prim::TensorExprGroup", "prim::TensorExprDynamicGroup",
                          "prim::FusionGroup", "prim::CudaFusionGroup"})


class TorchScriptProgram(Program):
    """A Program whose TorchScript function can say what the graph executor
    fused (`fusion()`)."""

    def __init__(self, slots, call, single, source, fuses, grad):
        super().__init__(slots, call, single, source)
        self.fuses = fuses
        self.grad = grad
        self._fusion = None
        if fuses:
            _fusing.add(self)

    def fusion(self) -> dict:
        """What the graph executor made of this graph: `groups` (fusion
        groups in its optimized graph), `fused` (the aten ops inside them),
        `unfused` (aten ops left outside, by name) and `state`:

        - "optimized": the groups above (zero groups: NNC took no op);
        - "not optimized yet": the profiling executor optimizes a graph at
          its second run (the first one records the shapes it specializes
          on); until then nothing is fused;
        - "no fuser": nothing can fuse here (CPU without LLVM, or the fuser
          switched off): the executor runs the graph as it is;
        - "autograd": the graph builds autograd history and runs without
          the executor's optimizations (see _unoptimized).

        The optimized graph is the one specialized on the shapes of the first
        runs; other shapes take the executor's fallback path, which it
        specializes and fuses again on its own (torch's fusion strategy), with
        no new fastlazy compile."""
        if self._fusion is not None:
            return self._fusion
        if not self.fuses:
            return _fusion_state("no fuser")
        if self.grad:
            return _fusion_state("autograd")
        try:
            plans = self.call.get_debug_state().execution_plans
        except RuntimeError:     # (an internal assert: no optimized plan yet)
            return _fusion_state("not optimized yet")
        graphs = [plan.graph for plan in plans.values()]
        if not graphs:
            return _fusion_state("not optimized yet")
        groups, fused, unfused = 0, 0, {}
        for graph in graphs:
            for node in _walk(graph.nodes()):
                if node.kind() in FUSION_KINDS:
                    groups += 1
                    fused += _count_aten(node.g("Subgraph"))
                elif node.kind().startswith("aten::"):
                    unfused[node.kind()] = unfused.get(node.kind(), 0) + 1
        self._fusion = {"state": "optimized", "groups": groups, "fused": fused,
                        "unfused": unfused}
        return self._fusion


def _fusion_state(state):
    return {"state": state, "groups": 0, "fused": 0, "unfused": {}}


def _walk(nodes):
    """Every node of a graph, through the blocks of prim::If and prim::Loop
    (the executor's guards), not into fusion groups' subgraphs."""
    stack = list(nodes)[::-1]
    while stack:
        node = stack.pop()
        yield node
        for block in node.blocks():
            stack.extend(list(block.nodes())[::-1])


def _count_aten(subgraph):
    """aten ops in a fusion group's subgraph (nested groups included)."""
    n = 0
    for node in _walk(subgraph.nodes()):
        if node.kind().startswith("aten::"):
            n += 1
        elif node.kind() in FUSION_KINDS:
            n += _count_aten(node.g("Subgraph"))
    return n


def fusion_of(program) -> dict | None:
    """A cached program's fusion (TorchScriptProgram.fusion), or None if
    TorchScript did not compile it; a tiered program's fast tier is read."""
    program = getattr(program, "fast", program)
    return program.fusion() if isinstance(program, TorchScriptProgram) else None


def any_fusing() -> bool:
    """Does any program compiled to fuse still live?"""
    return len(_fusing) > 0


def _emit(ir, env, node, program, inplace, scalars):
    """The IR of a node's program (its own, or base.written_form's); the
    SSA names of its outputs.  inplace: its one call is the `<name>_`
    variant, computing into its first operand.

    The lines come from the node's _Template: a model's graph repeats a
    few programs many times (each layer's), and a template's lines are
    filled in at a fraction of the cost of emitting them anew."""
    ins = [env[i] for i in node.inputs]
    numbers = tuple(a in scalars for a in ins)
    key = (program, inplace, node.detach, numbers)
    template = _templates.get(key)
    if template is None:
        template = _Template(program, inplace, node.detach, numbers)
        if len(_templates) >= _MAX_TEMPLATES:
            _templates.clear()
        _templates[key] = template
    return template.fill(ir, ins)


def _emit_program(ir, ins, detach, program, inplace, scalars):
    """The IR of `program` over the SSA names `ins`; its outputs' names."""
    if detach:
        ins = [a if a in scalars else ir.call("detach", [a]) for a in ins]
    values = []

    def ref(r):
        return ins[r.k] if isinstance(r, Input) else values[r.k]

    for call in program.calls:
        values.append(_emit_call(ir, call, ref, inplace))
    return [ref(o) for o in program.outputs]


# (program, inplace, detach, which inputs are numbers) -> its _Template
_templates: dict = {}
_MAX_TEMPLATES = 8192


class _TemplateIR(_IR):
    """An _IR that writes format fields where names go: {i[k]} for input
    k, {c[k]} for constant k (interned in the graph's IR when filled),
    {f[k]} for the k-th new value.  (No line the emitter writes holds a
    brace of its own: constants' values, the only free text, are fields.)"""

    def __init__(self):
        super().__init__()
        self.values = []      # (_IR.consts' key, value) of constant k

    def fresh(self):
        self.n += 1
        return f"{{f[{self.n - 1}]}}"

    def constant(self, value):
        if isinstance(value, (list, tuple)):
            return super().constant(value)     # a ListConstruct of constants
        if isinstance(value, torch.dtype):
            value = SCALAR_TYPE[value]
        key = _constant_key(value)
        if key not in self.consts:
            self.consts[key] = f"{{c[{len(self.values)}]}}"
            self.values.append((key, value))
        return self.consts[key]


class _Template:
    """A node program's IR lines, emitted once, as one format string whose
    fields are the names (_TemplateIR)."""

    __slots__ = ("values", "fresh", "block", "outs")

    def __init__(self, program, inplace, detach, numbers):
        ir = _TemplateIR()
        ins = [f"{{i[{k}]}}" for k in range(len(numbers))]
        scalars = {a for a, number in zip(ins, numbers) if number}
        self.outs = _emit_program(ir, ins, detach, program, inplace, scalars)
        self.values = ir.values
        self.fresh = ir.n
        self.block = "\n".join(ir.lines)

    def fill(self, ir, ins):
        """Append the lines to `ir`, names filled in (new constants' lines
        first); the outputs' names."""
        known = ir.consts
        consts = [known.get(key) or ir.constant(value) for key, value in self.values]
        fresh = [f"%t{k}" for k in range(ir.n + 1, ir.n + 1 + self.fresh)]
        ir.n += self.fresh
        if self.block:
            ir.lines.append(self.block.format(i=ins, c=consts, f=fresh))
        return [out.format(i=ins, c=consts, f=fresh) for out in self.outs]


def _emit_call(ir, call, ref, inplace):
    """One aten call as IR.  A call that names its overload has every schema
    argument spelled out (the IR has no defaults), typed so that the right
    overload matches; one whose arguments choose it passes them as given."""
    if call.overload is operator.getitem:
        source, k = call.args
        found = ref(source)
        return (found[k] if isinstance(found, tuple)
                else ir.call("__getitem__", [found, ir.constant(k)]))
    if call.overload is SYM_SIZE:
        # a size read when the graph runs (fastlazy.symbolic_sizes)
        source, dim = call.args
        return ir.call("size", [ref(source), ir.constant(dim)], type="int")
    if call.overload is FLOORDIV:
        # a size computed from one (unflatten's -1)
        return ir.call("floordiv", [_ir_value(ir, a, None, ref) for a in call.args], type="int")
    if call.overload is None:
        kwargs = list(call.kwargs)
        # The IR passes keywords positionally and matches overloads by them:
        # a trailing None the op defaults to anyway is left out, since it
        # can name another overload (div's rounding_mode=None names
        # div.Tensor_mode, which NNC does not fuse; div.Tensor is the same
        # true division and fuses).
        while kwargs and kwargs[-1][1] is None and kwargs[-1][0] in call.optional:
            kwargs.pop()
        args = [_ir_value(ir, a, None, ref) for a in (*call.args, *(v for _, v in kwargs))]
        return ir.call(call.name + "_" if inplace else call.name, args)
    name, arguments, returns = _schema_of(call.overload)
    kwargs = dict(call.kwargs)
    args = []
    for i, arg in enumerate(arguments):
        if i < len(call.args):
            value = call.args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        elif arg.has_default:
            value = arg.default
        else:
            raise TypeError(f"{name}: no value for {arg.name}")
        value = _NEUTRAL_FLAGS.get((name, arg.name), value)
        if type(value) is bool and arg.kind in ("number", "Optional[number]"):
            args.append(_bool_number(ir, arg.name, value, kwargs.get("dtype")))
        else:
            args.append(_ir_value(ir, value, arg, ref))
    if len(returns) == 1:
        return ir.call(name, args, type=returns[0])
    outs = tuple(ir.fresh() for _ in returns)
    typed = ", ".join(f"{o} : {t}" for o, t in zip(outs, returns))
    ir.lines.append(f"  {typed} = {name}({', '.join(args)})")
    return outs


class _Argument(NamedTuple):
    """What the emitter reads of a schema argument, read once per overload:
    each read of a FunctionSchema's arguments builds its Python objects
    anew (about 9 us for a six-argument op, most of a node's emission)."""
    name: str
    kind: str            # the type as torch prints it: "List[int]", "Optional[Tensor]"
    has_default: bool
    default: object
    N: int | None        # a fixed list length (int[2]), or None


_schemas: dict = {}

# Arguments that change no value but that the graph executor's passes read
# as permission to rewrite the graph: RemoveExpands deletes every
# `aten::expand(..., implicit=True)`, taking it for a broadcast that tracing
# inserted, so `x.expand(3, 4, implicit=True)` would keep x's shape on CUDA
# (where the graph executor runs).  Emitted with the neutral value instead.
_NEUTRAL_FLAGS = {("aten::expand", "implicit"): False}


def _schema_of(overload):
    """(qualified name, [_Argument], IR types of the returns) of an
    OpOverload's schema."""
    found = _schemas.get(overload)
    if found is None:
        schema = overload._schema
        arguments = tuple(
            _Argument(a.name, str(a.type), a.has_default_value(),
                      a.default_value if a.has_default_value() else None, a.N)
            for a in schema.arguments)
        returns = [_ir_type(r.type) for r in schema.returns]
        found = _schemas[overload] = (schema.name, arguments, returns)
    return found


# TorchScript has no bool Scalar: a Python bool passed where a Scalar goes
# fails its alias analysis (an INTERNAL ASSERT: `bool_t & True`).  A 0-dim
# bool tensor promotes exactly as a Python bool does (bool is the lowest
# category), so a bool slot, or an operand that promotes, becomes one.

def _bool_tensor(ir, value):
    return ir.call("scalar_tensor", [
        ir.constant(int(value)), ir.constant(SCALAR_TYPE[torch.bool]),
        ir.constant(None), ir.constant(None), ir.constant(None)])


def _bool_number(ir, name, value, dtype):
    """A Python bool for a Scalar argument `name` of a named overload: an
    operand that promotes (`other`) as a 0-dim bool tensor (the op's
    Tensor overload then matches); a fill value (scatter's, masked_fill's
    `value`) or scalar_tensor's `s` given a dtype as an int, which fills
    the same; anything else as it is."""
    if name == "other":
        return _bool_tensor(ir, value)
    if name == "value" or name == "s" and dtype is not None:
        return ir.constant(int(value))
    return ir.constant(value)


def _ir_type(t):
    text = str(t)
    return {"Tensor": "Tensor", "List[Tensor]": "Tensor[]"}.get(text) or _unsupported(text)


def _unsupported(text):
    raise TypeError(f"no TorchScript lowering for a {text} result")


def _ir_value(ir, value, arg, ref):
    """An argument as IR: typed by its schema argument `arg`, or (None) as
    its Python value says."""
    if isinstance(value, REFS):
        return ref(value)
    if isinstance(value, Sizes):
        sizes = ir.call("size", [ref(value.of)], type="int[]")
        return ir.call("slice", [sizes, ir.constant(-value.count), ir.constant(None),
                                 ir.constant(1)], type="int[]")
    kind = "" if arg is None else arg.kind
    if isinstance(value, (list, tuple)):
        if "Tensor" in kind:
            items = [ir.constant(None) if v is None else ref(v) for v in value]
            return ir.list(items, "Tensor?[]" if "Optional[Tensor]" in kind else "Tensor[]")
        if "bool" in kind:
            return ir.list([ir.constant(bool(v)) for v in value], "bool[]")
        if "float" in kind:
            return ir.list([ir.constant(float(v)) for v in value], "float[]")
        if any(isinstance(v, REFS) for v in value):
            # sizes read when the graph runs, beside constant ones
            return ir.list([ref(v) if isinstance(v, REFS) else ir.constant(v)
                            for v in value], "int[]")
        return ir.constant(list(value))
    if isinstance(value, (torch.layout, torch.memory_format)):
        return ir.constant(_ENUM_INTS[value])
    if arg is None:
        return ir.constant(value)
    if type(value) is int and kind.startswith("List[int]") and arg.N:
        return ir.constant([value] * arg.N)
    if isinstance(value, torch.device):
        key = ("device", str(value))
        if key not in ir.consts:
            name = ir.fresh()
            ir.lines.append(f'  {name} : Device = prim::Constant[value="{value}"]()')
            ir.consts[key] = name
        return ir.consts[key]
    if type(value) is float and (value != value or abs(value) == float("inf")):
        # the IR's constant syntax has no inf/nan: build it from a string
        return ir.call("Float", [ir.constant(repr(value))], type="float")
    return ir.constant(value)


def _executor_program(text):
    """The graph on fastlazy's step executor, where it is on and can run
    every node; else None (the interpreter runs it)."""
    if not step_executor.enabled():
        return None
    try:
        return step_executor.compile(text)
    except RuntimeError:
        metrics.count_event("executor_refusals")
        return None


class _unoptimized:
    """A graph no fuser acts on, run by the graph executor without its
    optimization passes.  The executor reads the flag at every call and
    plans once per flag: optimized, the plan took 10-16 ms of a W4 model's
    first or second call (GPT-2's 87-node graph: 14 ms) and ran the calls
    after it no faster (fastlazy's IR leaves the passes nothing to fold or
    eliminate).  And a graph whose inputs require grad must run so:
    optimized, its autodiff subgraphs fail inside TorchScript (an INTERNAL
    ASSERT in alias analysis, "We don't have an op for aten::mul") when an
    intermediate is kept across backward or for double backward;
    unoptimized, the executor runs the ops one by one and autograd records
    them as eager does.  (The flag is per thread; it is restored after the
    call.)

    torch's default executor, the profiling one, then runs its fallback
    plan (the graph after the no-optimization pass pipeline), planned at
    the first run: 1.0-1.5 ms for GPT-2's and BERT's W4 graphs, where the
    legacy executor's first run, which also runs its required passes and
    shape analysis, took 1.4-2.0 ms; both run the calls after it at the
    same speed."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *inputs):
        previous = torch._C._get_graph_executor_optimize()
        torch._C._set_graph_executor_optimize(False)
        try:
            return self.fn(*inputs)
        finally:
            torch._C._set_graph_executor_optimize(previous)
