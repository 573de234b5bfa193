"""The shell a Megatron-LM launch script is written in, as far as its arguments need it.

Megatron-LM's own example scripts (``examples/gpt3/train_gpt3_175b_distributed.sh``) collect
their arguments in shell arrays and variables and launch
``torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${GPT_MODEL_ARGS[@]} ...``. This module runs
the part of the shell (POSIX sh and bash, "Shell Command Language", IEEE Std 1003.1 section 2,
and the Bash Reference Manual, "Arrays") that such scripts use, without running anything:

* assignments ``NAME=value``, ``NAME+=value``, ``export NAME=value``, arrays ``NAME=( ... )``
  and ``NAME+=( ... )`` (over several lines, with comments and line continuations);
* references ``$NAME``, ``${NAME}``, ``${NAME:-default}``, ``${NAME-default}``,
  ``${ARR[@]}``, ``${ARR[*]}``, ``${ARR[i]}``; an unquoted expansion is split into words, a
  quoted one is not (``"${ARR[@]}"`` is one word per element);
* integer arithmetic ``$(( ... ))`` of numbers and variables (``+ - * / %``);
* quoting (``'...'``, ``"..."``, ``\\``), comments, ``;``, ``&&``, ``||``, pipes and redirections.

``$@`` and ``$*`` (the arguments the script itself is run with) are unknown: they expand to
nothing, as for a script run without arguments, and ``Script.own_arguments`` says they were used.

A variable the script does not set (a positional ``$1``, the environment) stays as written, so
that ``--save $CHECKPOINT_PATH`` keeps a value and a number read from it is refused by name.
Command substitution (``$(...)``, backticks) and other parameter expansions are never run: a
word that needs one reaches the Megatron arguments only to be refused (``ConfigError``, one
line); before the ``*.py`` (the launcher's own words) it counts as not stated.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from checker._import_common import ConfigError
from formal._input import printable

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
_OPS = ";&|()"
_PLAIN = re.compile(r"[^\s;&|()<>\\'\"$`]+")  # a run of characters with no meaning to the shell
_DECLARE = ("export", "declare", "typeset", "local", "readonly")
MAX_EXPANDED = 1_000_000  # characters a variable or command may expand to (arrays doubling per line)


@dataclass(frozen=True)
class _Part:
    """One piece of a shell word: literal text, a reference, or a substitution."""

    kind: str  # "lit", "var", "arith", "cmd", "bad" (an expansion this reader does not run)
    text: str  # literal text, a variable name, or the substitution's source as written
    quoted: bool
    index: str | None = None  # "@", "*" or a number: ${NAME[index]}
    default: str | None = None  # ${NAME:-default} / ${NAME-default}
    colon: bool = False  # ":-" (also for an empty value) rather than "-"
    source: str = ""  # the reference as written


@dataclass(frozen=True)
class _Token:
    kind: str  # "word", "op", "array" (NAME=( opens an array), "redir"
    parts: tuple[_Part, ...] = ()
    text: str = ""


# A field of an expanded word: its text and, when it needed a substitution that is not run, what.
Field = tuple[str, str | None]


class _Lexer:
    def __init__(self, text: str, where: str) -> None:
        self.s = text
        self.i = 0
        self.where = where

    def fail(self, what: str) -> ConfigError:
        line = self.s.count("\n", 0, self.i) + 1
        return ConfigError(f"{self.where}: line {line}: {what}")

    def tokens(self) -> list[_Token]:
        out: list[_Token] = []
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if s.startswith("\\\n", self.i):
                self.i += 2
            elif c in " \t\r":
                self.i += 1
            elif c == "\n":
                out.append(_Token("op", text="\n"))
                self.i += 1
            elif c == "#":
                while self.i < len(s) and s[self.i] != "\n":
                    self.i += 1
            elif c in _OPS:
                j = self.i + 1
                if j < len(s) and s[j] == c and c in "&|;":
                    j += 1
                out.append(_Token("op", text=s[self.i : j]))
                self.i = j
            elif c in "<>":
                self._redirection(out)
            else:
                out.append(self._word())
        return out

    def _redirection(self, out: list[_Token]) -> None:
        s = self.s
        if out and out[-1].kind == "word" and _fd(out[-1]):
            out.pop()  # the descriptor of 2>file
        self.i += 1
        while self.i < len(s) and s[self.i] in "<>&|":
            self.i += 1
        out.append(_Token("redir"))

    def _word(self) -> _Token:
        s = self.s
        parts: list[_Part] = []
        lit: list[str] = []

        def flush(quoted: bool = False) -> None:
            if lit:
                parts.append(_Part("lit", "".join(lit), quoted))
                lit.clear()

        while self.i < len(s):
            c = s[self.i]
            if c in " \t\r\n" or c in _OPS or c in "<>":
                if c == "(" and not parts and lit and _ASSIGN.fullmatch("".join(lit)):
                    name = "".join(lit)
                    self.i += 1
                    return _Token("array", text=name)
                break
            if s.startswith("\\\n", self.i):
                self.i += 2
            elif c == "\\":
                flush()
                if self.i + 1 < len(s):
                    parts.append(_Part("lit", s[self.i + 1], True))
                self.i += 2
            elif c == "'":
                flush()
                end = s.find("'", self.i + 1)
                if end < 0:
                    raise self.fail("unterminated ' quote")
                parts.append(_Part("lit", s[self.i + 1 : end], True))
                self.i = end + 1
            elif c == '"':
                flush()
                parts.extend(self._double_quoted())
            elif c == "$":
                flush()
                parts.append(self._dollar(quoted=False))
            elif c == "`":
                flush()
                parts.append(self._backtick(quoted=False))
            else:
                run = _PLAIN.match(s, self.i)
                end = run.end() if run and run.end() > self.i else self.i + 1
                lit.append(s[self.i : end])
                self.i = end
        flush()
        return _Token("word", tuple(parts))

    def _double_quoted(self) -> list[_Part]:
        s = self.s
        start = self.i
        self.i += 1
        parts: list[_Part] = [_Part("lit", "", True)]  # "" is a word, even when empty
        lit: list[str] = []
        while True:
            if self.i >= len(s):
                self.i = start
                raise self.fail('unterminated " quote')
            c = s[self.i]
            if c == '"':
                self.i += 1
                break
            if c == "\\" and self.i + 1 < len(s) and s[self.i + 1] in '$`"\\\n':
                if s[self.i + 1] != "\n":
                    lit.append(s[self.i + 1])
                self.i += 2
            elif c == "$" or c == "`":
                if lit:
                    parts.append(_Part("lit", "".join(lit), True))
                    lit.clear()
                parts.append(self._dollar(quoted=True) if c == "$" else self._backtick(quoted=True))
            else:
                lit.append(c)
                self.i += 1
        if lit:
            parts.append(_Part("lit", "".join(lit), True))
        if [p.kind for p in parts] == ["lit", "own"] and not parts[0].text:
            return parts[1:]  # "$@" of no arguments is no word
        return parts

    def _backtick(self, quoted: bool) -> _Part:
        end = self.s.find("`", self.i + 1)
        if end < 0:
            raise self.fail("unterminated ` (command substitution)")
        source = self.s[self.i : end + 1]
        self.i = end + 1
        return _Part("cmd", source, quoted, source=source)

    def _closing(self, open_: str, close: str, start: int) -> int:
        """The index just past the ``close`` that matches the opening at ``start`` (quotes skipped)."""
        s, depth, j = self.s, 0, start
        while j < len(s):
            c = s[j]
            if c == "\\":
                j += 2
                continue
            if c in "'\"":
                end = s.find(c, j + 1)
                if end < 0:
                    break
                j = end + 1
                continue
            if c == open_:
                depth += 1
            elif c == close:
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        self.i = start
        raise self.fail(f"unterminated {s[start - 1 : start + 1]!r}")

    def _dollar(self, quoted: bool) -> _Part:
        s, i = self.s, self.i
        if s.startswith("$((", i):
            end = self._closing("(", ")", i + 1)
            source = s[i:end]
            self.i = end
            return _Part("arith", source[3:-2], quoted, source=source)
        if s.startswith("$(", i):
            end = self._closing("(", ")", i + 1)
            source = s[i:end]
            self.i = end
            return _Part("cmd", source, quoted, source=source)
        if s.startswith("${", i):
            end = self._closing("{", "}", i + 1)
            source = s[i:end]
            self.i = end
            return _braced(source, quoted)
        m = _NAME.match(s, i + 1)
        if m:
            self.i = m.end()
            return _Part("var", m.group(), quoted, source=s[i : m.end()])
        if i + 1 < len(s) and s[i + 1] in "@*":
            self.i = i + 2  # the script's own arguments: none (noted by ``script_command``)
            return _Part("own", s[i : i + 2], quoted)
        if i + 1 < len(s) and (s[i + 1].isdigit() or s[i + 1] in "#?$!-"):
            self.i = i + 2  # a positional or special parameter: the script does not set it
            return _Part("lit", s[i : i + 2], quoted)
        self.i = i + 1
        return _Part("lit", "$", quoted)


def _fd(token: _Token) -> bool:
    return len(token.parts) == 1 and token.parts[0].kind == "lit" and token.parts[0].text.isdigit()


_BRACED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:\[([@*]|[0-9]+)\])?(?:(:?)-(.*))?\}", re.DOTALL)


def _braced(source: str, quoted: bool) -> _Part:
    m = _BRACED.fullmatch(source)
    if m is None:
        if source in ("${@}", "${*}"):
            return _Part("own", source, quoted)
        if re.fullmatch(r"\$\{[0-9@*#?$!-]\}", source):
            return _Part("lit", source, quoted)
        return _Part("bad", source, quoted, source=source)
    name, index, colon, default = m.groups()
    if default is not None and index is not None:
        return _Part("bad", source, quoted, source=source)
    return _Part("var", name, quoted, index=index, default=default, colon=bool(colon), source=source)


class _Fields:
    """Words being built from parts: unquoted expansions split at blanks, quoted ones do not."""

    def __init__(self) -> None:
        self.done: list[str] = []
        self.cur: str | None = None

    def end(self) -> None:
        if self.cur is not None:
            self.done.append(self.cur)
            self.cur = None

    def add(self, text: str, split: bool) -> None:
        if not split:
            self.cur = (self.cur or "") + text
            return
        pieces = text.split()
        if text[:1].isspace():
            self.end()
        for k, piece in enumerate(pieces):
            if k:
                self.end()
            self.cur = (self.cur or "") + piece
        if text[-1:].isspace():
            self.end()

    def result(self) -> list[str]:
        self.end()
        return self.done


_Value = tuple[tuple[str, ...], str | None]  # the elements (one for a scalar) and a taint


class Shell:
    """The variables and arrays a script has set so far, and the commands it ran."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.vars: dict[str, _Value] = {}
        self.commands: list[list[Field]] = []
        self.own = False  # whether the script passes on its own arguments ($@, $*) anywhere
        self.size = 0  # characters of the commands so far

    def run(self, text: str) -> None:
        tokens = _Lexer(text, self.where).tokens()
        statement: list[_Token] = []
        k = 0
        while k < len(tokens):
            tok = tokens[k]
            if tok.kind == "array":
                end = k + 1
                while end < len(tokens) and not (tokens[end].kind == "op" and tokens[end].text == ")"):
                    end += 1
                if end == len(tokens):
                    raise ConfigError(f"{self.where}: array {tok.text}( is not closed by )")
                self._array(tok.text, [t for t in tokens[k + 1 : end] if t.kind == "word"])
                k = end + 1
                continue
            if tok.kind == "op" and tok.text not in "()":
                self._statement(statement)
                statement = []
            elif tok.kind != "op":
                statement.append(tok)
            k += 1
        self._statement(statement)

    def _array(self, head: str, words: list[_Token]) -> None:
        m = _ASSIGN.fullmatch(head)
        assert m is not None
        name, plus = m.groups()
        elements: list[str] = []
        taint: str | None = None
        for w in words:
            for text, why in self.expand(w.parts):
                elements.append(text)
                taint = taint or why
        if plus and name in self.vars:
            old, old_taint = self.vars[name]
            elements, taint = [*old, *elements], old_taint or taint
        if sum(len(e) + 1 for e in elements) > MAX_EXPANDED:
            raise ConfigError(f"{self.where}: array {name} expands past {MAX_EXPANDED:,} characters")
        self.vars[name] = (tuple(elements), taint)

    def _statement(self, words: list[_Token]) -> None:
        kept: list[_Token] = []
        skip = False
        for w in words:  # the word after a redirection is its target, not an argument
            if w.kind == "redir":
                skip = True
            elif skip:
                skip = False
            else:
                kept.append(w)
        k = 0
        if kept and _literal(kept[0]) in _DECLARE:
            k = 1
            while k < len(kept) and (_literal(kept[k]) or "").startswith("-"):
                k += 1
        start = k
        while k < len(kept) and self._assignment(kept[k]):
            k += 1
        if k == len(kept) or start > 0:
            return  # assignments only (export NAME, declare -a NAME, ...)
        fields: list[Field] = []
        for w in kept[k:]:
            fields.extend(self.expand(w.parts))
        if fields:
            self.commands.append(fields)
            self.size += sum(len(w) + 1 for w, _ in fields)
            if self.size > MAX_EXPANDED:
                raise ConfigError(f"{self.where}: the script's commands expand past {MAX_EXPANDED:,} characters")

    def _assignment(self, word: _Token) -> bool:
        first = word.parts[0] if word.parts else None
        if first is None or first.kind != "lit" or first.quoted:
            return False
        m = _ASSIGN.match(first.text)
        if m is None:
            return False
        name, plus = m.groups()
        rest = (_Part("lit", first.text[m.end() :], False), *word.parts[1:])
        texts = self.expand(rest, split=False)
        value = "".join(t for t, _ in texts)
        taint = next((why for _, why in texts if why), None)
        if plus and name in self.vars:
            old, old_taint = self.vars[name]
            value, taint = (old[0] if old else "") + value, old_taint or taint
        if len(value) > MAX_EXPANDED:
            raise ConfigError(f"{self.where}: variable {name} expands past {MAX_EXPANDED:,} characters")
        self.vars[name] = ((value,), taint)
        return True

    def expand(self, parts: tuple[_Part, ...], split: bool = True) -> list[Field]:
        """The words ``parts`` expand to (one word when ``split`` is false, as in an assignment)."""
        out = self._expand(parts, split)
        if sum(len(w) + 1 for w, _ in out) > MAX_EXPANDED:
            raise ConfigError(f"{self.where}: the script's variables expand past {MAX_EXPANDED:,} characters")
        return out

    def _expand(self, parts: tuple[_Part, ...], split: bool) -> list[Field]:
        fields = _Fields()
        taint: str | None = None
        for p in parts:
            match p.kind:
                case "lit":
                    fields.add(p.text, False)
                case "own":
                    self.own = True
                case "cmd":
                    taint = taint or f"command substitution {printable(p.source, 60)}"
                    fields.add(p.source, False)
                case "bad":
                    taint = taint or f"parameter expansion {printable(p.source, 60)}"
                    fields.add(p.source, False)
                case "arith":
                    value = self._arith(p.text)
                    if value is None:
                        taint = taint or f"arithmetic {printable(p.source, 60)} (integers and + - * / % only)"
                        fields.add(p.source, False)
                    else:
                        fields.add(str(value), False)
                case "var":
                    elements, why = self._lookup(p)
                    taint = taint or why
                    if not split or (p.index == "*" and p.quoted):
                        fields.add(" ".join(elements), False)  # one word: an assignment, "${A[*]}"
                    else:
                        for k, element in enumerate(elements):
                            if k:
                                fields.end()  # each element its own word
                            fields.add(element, not p.quoted)
                case _:
                    raise AssertionError(p.kind)
        return [(w, taint) for w in fields.result()]

    def _lookup(self, p: _Part) -> tuple[tuple[str, ...], str | None]:
        if p.text in self.vars:
            elements, why = self.vars[p.text]
            if p.index is None or p.index.isdigit():
                k = int(p.index or 0)
                elements = elements[k : k + 1]
            if not (p.default is not None and (not elements or (p.colon and elements == ("",)))):
                return elements, why
        elif p.default is None:
            return (p.source,), None  # not set by the script: kept as written
        assert p.default is not None
        texts = self.expand(_Lexer(p.default, self.where)._word().parts, split=False)
        return ("".join(t for t, _ in texts),), next((why for _, why in texts if why), None)

    def _arith(self, text: str) -> int | None:
        """``$(( ... ))`` of integers and variables with + - * / % and parentheses, else None."""

        def name(m: re.Match[str]) -> str:
            value = self.vars.get(m.group(1) or m.group(2))
            if value is None or value[1] or len(value[0]) != 1 or not value[0][0].strip().isdigit():
                raise ValueError(m.group())
            return value[0][0].strip()

        try:
            expr = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?|\b([A-Za-z_][A-Za-z0-9_]*)\b", name, text)
            return _evaluate(ast.parse(expr.strip(), mode="eval").body)
        except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
            return None


def _evaluate(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if abs(left) > 2**64 or abs(right) > 2**64:
            raise ValueError("too large")
        match node.op:
            case ast.Add():
                return left + right
            case ast.Sub():
                return left - right
            case ast.Mult():
                return left * right
            case ast.Div() | ast.FloorDiv():  # the shell divides integers toward zero
                quotient = abs(left) // abs(right)
                return quotient if (left >= 0) == (right >= 0) else -quotient
            case ast.Mod():
                return left - right * int(left / right)
    raise ValueError("not integer arithmetic")


def _literal(token: _Token) -> str | None:
    if len(token.parts) == 1 and token.parts[0].kind == "lit" and not token.parts[0].quoted:
        return token.parts[0].text
    return None


@dataclass(frozen=True)
class Script:
    """A launch script's command: the launcher's words, the arguments after the ``*.py``, and
    whether the script passes on its own arguments anywhere (``$@``, read as none)."""

    launcher: list[Field]
    arguments: list[Field]
    own_arguments: bool


def script_command(text: str, where: str) -> tuple[list[Field], list[Field]]:
    """``read_script``'s launcher and arguments."""
    script = read_script(text, where)
    return script.launcher, script.arguments


def read_script(text: str, where: str) -> Script:
    """The launcher's words and the Megatron arguments of a launch line, script or arguments file.

    The command is the first that runs a ``*.py`` (a ``pretrain_*.py`` first): the launcher is
    what comes before it, the arguments what comes after. Without one, the arguments are the
    script's command words from the first ``--``."""
    shell = Shell(where)
    shell.run(text)
    runs = [n for n, c in enumerate(shell.commands) if any(t.endswith(".py") for t, _ in c)]
    runs.sort(key=lambda n: not any(t.endswith(".py") and "pretrain" in t for t, _ in shell.commands[n]))
    if runs:
        command = shell.commands[runs[0]]
        k = next(k for k, (t, _) in enumerate(command) if t.endswith(".py"))
        return Script(command[:k], command[k + 1 :], shell.own)
    words = [f for c in shell.commands for f in c]
    first = next((k for k, (t, _) in enumerate(words) if t.startswith("--")), len(words))
    return Script([], words[first:], shell.own)


def arguments(fields: list[Field], where: str) -> list[str]:
    """The Megatron arguments as text: a word that needs a substitution this reader does not run
    is refused, naming it and the argument it belongs to."""
    out: list[str] = []
    for k, (text, why) in enumerate(fields):
        if why is not None:
            arg = next((t for t, _ in reversed(fields[:k]) if t.startswith("--")), None)
            at = f" (the value of {arg})" if arg and not text.startswith("--") else ""
            raise ConfigError(
                f"{where}: {why}{at} is not run: write the value in the script (only variables, arrays "
                "and $((arithmetic)) are expanded)"
            )
        out.append(text)
    return out
