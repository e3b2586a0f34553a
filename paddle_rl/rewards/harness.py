"""The test harness: the `main.py` of every sandboxed run (sandbox.py). It runs INSIDE the sandbox, in the same
interpreter as the untrusted program, and imports nothing of this project (it is copied in as a file).

It reads what it needs before the program runs (from the descriptors its first argument names: a one-time marker
from the caller, then a JSON spec holding the program and, for a test run, the one test) and closes them, drops to the sandbox user when told
to, applies the process limit, then runs the program as `__main__` (file name solution.py). For a test run it then
runs the test and writes the verdict line `<marker> <json>` to the verdict descriptor. The caller trusts a test's outcome only from
that line: a program that ends the process early (sys.exit, os._exit, SystemExit, a signal) writes no verdict
and fails, whatever its exit status.

The test runs with guards the program cannot replace afterwards:
- builtins are a copy taken before the program ran (a program that patches `all` or `isinstance` changes its own
  builtins, not the test's);
- every value returned by a function the program defined, and every operand of a comparison (other than `is`),
  of an assert, of `not` / `and` / `or` and of an `if` in the test, must be of a builtin type (None, bool, int,
  float, complex, str, bytes, list, tuple, dict, set, frozenset, containers checked element by element): an
  object whose `__eq__`, `__bool__` or `__sub__` lies fails the test as `bad_type`.
What it does not stop: a program written against this harness (one that reads the marker's descriptor before the harness does, or
finds the marker in the interpreter's memory, and writes a forged verdict), or one that patches a standard module
the test imports (`math.isclose`). docs/rewards.md lists the routes.
"""
import ast
import builtins
import json
import os
import sys
import traceback

PLAIN = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)


class BadType(Exception):
    """A value of a non-builtin type reached a comparison, a truth test or a return."""


def _read_fd(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _checker(_type=type, _id=id, _plain=frozenset(PLAIN), _dict=dict, _containers=(list, tuple, set, frozenset),
             _bad=BadType, _len=len):
    def plain(value, where="a value"):
        stack, seen = [value], set()
        while stack:
            x = stack.pop()
            t = _type(x)
            if t not in _plain:
                raise _bad(f"{where} is of type {t.__name__}, not a builtin type")
            if t is _dict:
                if _id(x) not in seen:
                    seen.add(_id(x))
                    stack.extend(x.keys())
                    stack.extend(x.values())
            elif t in _containers and _len(x):
                if _id(x) not in seen:
                    seen.add(_id(x))
                    stack.extend(x)
        return value

    def truth(value):
        return bool(plain(value, "a tested value"))

    return plain, truth


class _Guard(ast.NodeTransformer):
    """Wraps the operands of comparisons and truth tests of the (trusted) test code in the plain-type check."""

    @staticmethod
    def _wrap(node, name="__prl_plain__"):
        return ast.copy_location(ast.Call(func=ast.Name(name, ast.Load()), args=[node], keywords=[]), node)

    def visit_Compare(self, node):
        self.generic_visit(node)
        if all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            return node
        node.left = self._wrap(node.left)
        node.comparators = [self._wrap(c) for c in node.comparators]
        return node

    def visit_Assert(self, node):
        self.generic_visit(node)
        node.test = self._wrap(node.test, "__prl_truth__")
        return node

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        node.values = [self._wrap(v) for v in node.values]
        return node

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Not):
            node.operand = self._wrap(node.operand)
        return node

    def _test(self, node):
        self.generic_visit(node)
        node.test = self._wrap(node.test, "__prl_truth__")
        return node

    visit_If = visit_While = visit_IfExp = _test


def _returns_plain(fn, plain):
    name = getattr(fn, "__name__", "a function")

    def call(*args, **kwargs):
        return plain(fn(*args, **kwargs), f"the value returned by {name}()")
    call.__name__ = name
    return call


def main():
    verdict_fd, marker_fd, spec_fd = (int(fd) for fd in sys.argv[1].split(","))
    marker = _read_fd(marker_fd).decode()
    spec = json.loads(_read_fd(spec_fd).decode())
    out, err, write, exit_now = sys.stdout, sys.stderr, os.write, os._exit
    safe_builtins = dict(builtins.__dict__)
    # what the harness itself needs after the program ran, taken before (a program may rebind builtins)
    assertion, system_exit, memory_error, base_exception, is_callable, dict_, run, get, type_ = (
        AssertionError, SystemExit, MemoryError, BaseException, callable, dict, exec, getattr, type)
    dumps, loads = json.dumps, json.loads
    plain, truth = _checker()
    drop = spec.get("drop_to")
    if drop is not None:
        os.setgroups([])
        os.setgid(drop)
        os.setuid(drop)
    if spec.get("nproc"):
        import resource
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    test = spec.get("test")
    if test is not None:  # compiled before the program runs: the program cannot change how
        test_code = compile(ast.fix_missing_locations(_Guard().visit(ast.parse(test["code"]))), "test.py", "exec") \
            if "code" in test else None

    def verdict(outcome, **extra):
        try:
            out.flush()
        except Exception:  # noqa: BLE001
            pass
        write(verdict_fd, (marker + " " + dumps({"outcome": outcome, **extra}) + "\n").encode())
        exit_now(0)

    program = spec["program"]
    namespace = {"__name__": "__main__", "__file__": "solution.py", "__builtins__": builtins}
    with open("solution.py", "w", encoding="utf-8") as f:
        f.write(program)
    sys.argv = ["solution.py"]
    try:
        exec(compile(program, "solution.py", "exec"), namespace)
    except SystemExit as e:
        if test is not None:
            verdict("early_exit")
        raise
    except BaseException as e:  # noqa: BLE001
        if test is None:
            raise
        traceback.print_exc(file=err)
        verdict("memory" if isinstance(e, MemoryError) else "runtime_error", error=type(e).__name__)
    if test is None:
        return
    sys.settrace(None)
    sys.setprofile(None)
    sys.stdout, sys.stderr = out, err
    env = dict_(namespace)
    for name, value in namespace.items():  # the program's own functions answer only in builtin types
        if get(value, "__globals__", None) is namespace:
            env[name] = _returns_plain(value, plain)
    env.update(__builtins__=safe_builtins, __prl_plain__=plain, __prl_truth__=truth, __name__="__test__")
    try:
        if "call" in test:
            fn = env.get(test["call"])
            if not is_callable(fn):
                verdict("runtime_error", error=f"no function {test['call']}")
            value = fn(*test["args"])
            verdict("returned", value=loads(dumps(value)))
        run(test_code, env)
        verdict("pass")
    except BadType as e:
        verdict("bad_type", error=str(e))
    except assertion:
        verdict("wrong_answer")
    except system_exit:
        verdict("early_exit")
    except memory_error:
        verdict("memory")
    except base_exception as e:  # noqa: BLE001
        traceback.print_exc(file=err)
        verdict("runtime_error", error=type_(e).__name__)


if __name__ == "__main__":
    main()
