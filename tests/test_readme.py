"""README.md is the front door: every command in its ```bash blocks runs as written (at least
with --help), every flag it passes exists, it stays short, and its install line and test command
are the ones CI (.ci/run) runs. Every page a user reads a command from (README.md, docs/**/*.md,
data-prep/README.md): each repository script's command, with the page's shell variables and
loops worked out, parses with the script's own parser or runs with the launcher's --dry-run (a
launcher whose --dry-run needs what the docs only name: its flags are checked against --help),
and its paths are the README pipeline's or placeholders."""

import contextlib
import fnmatch
import functools
import importlib
import io
import operator
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MODEL_DOC = REPO / "docs" / "model.md"
CI = REPO / ".ci" / "run"
MAX_README_BYTES = 15 * 1024

# what a command may invoke from the repository (as `python X`, `bash X`, `sbatch ... X` or X)
REPO_SCRIPT = re.compile(r"(scripts/[\w/-]+\.(py|sh)|scripts/slurm/\w+\.sbatch|studies/[\w/.-]+|data-prep/\w+\.sh)")
FAIRSEQ = ("fairseq-train", "fairseq-hydra-train", "fairseq-preprocess")
# fairseq-train's options that decide which options exist (the plugin's, the task's, ...): kept
# in front of --help, since fairseq-train --help knows only what they add
FAIRSEQ_SELECTORS = ("--user-dir", "--arch", "--task", "--criterion", "--optimizer", "--lr-scheduler", "--bpe")
# fairseq-train --help prints its parser before the plugin's and the task's options are added;
# this builds the whole parser from the command as written (as fairseq-train does), refuses
# unknown arguments, and prints the help of every option
FAIRSEQ_TRAIN_PARSE = """
import sys
from fairseq import options
parser = options.get_training_parser()
args, extra = options.parse_args_and_arch(parser, input_args=sys.argv[1:], parse_known=True)
if extra:
    sys.exit(f"fairseq-train does not know {extra}")
print(parser.format_help())
"""
SEPARATORS = {"&&", "||", ";", "|"}
# <<'PY' ... PY: a heredoc (not <<<, a here-string)
HEREDOC = re.compile(r"(?<!<)<<(?!<)-?\s*(['\"]?)(\w+)\1")
ARITHMETIC = re.compile(r"\$\(\((.*?)\)\)")
ARITHMETIC_WORD = re.compile(r"\$\(\((\w+)([-+*/])(\w+)\)\)")
REFERENCE = re.compile(r"\$\{(?P<name>\w+)(?:\[(?P<index>[@$\w]+)\])?(?:%(?P<suffix>[^}]+))?\}|\$(?P<plain>\w+)")
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
# the venv's entry points (fairseq-train) and its Python for the shell wrappers
ENV = dict(
    os.environ,
    PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    PYTHON=sys.executable,
    OMP_NUM_THREADS="1",
)


def readme_text():
    return README.read_text(encoding="utf-8")


def bash_blocks(text):
    return re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def logical_lines(block):
    """The block's lines as bash reads them: continuation lines joined, a quoted string or an
    array that spans lines kept whole, a heredoc's body (another program's input) left out."""
    lines = iter(block.replace("\\\n", " ").splitlines())
    for line in lines:
        if heredoc := HEREDOC.search(line):
            next((body for body in lines if body.strip() == heredoc[2]), None)
        while not complete(line):
            line += "\n" + next(lines)
        yield ARITHMETIC.sub(lambda m: "$((" + re.sub(r"\s", "", m[1]) + "))", line)  # one word


def complete(line):
    """Whether a line closes its quotes and its arrays' parentheses."""
    try:
        shlex.split(line, comments=True)
    except ValueError:  # an open quote
        return False
    return not re.search(r"\w=\(", line) or line.count("(") <= line.count(")")


def lex(line):
    """A line's simple commands as raw token lists (quotes removed, nothing expanded), split at
    ; && || |, a redirection and its target dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    command = []
    tokens = iter(lexer)
    for token in tokens:
        if token in SEPARATORS:
            yield command
            command = []
        elif re.fullmatch(r"[<>&]+", token):
            target = next(tokens, "")
            if token == "<<<":  # a here-string is read's input: kept
                command += [token, target]
        else:
            command.append(token)
    yield command


def statements(block):
    """The block's simple commands in order, raw, with `do` taken off the front of a loop's first."""
    for line in logical_lines(block):
        for command in lex(line):
            while command[:1] in (["do"], ["then"]):
                command = command[1:]
            if command:
                yield command


def split_commands(block, variables=None):
    """The commands of a bash block, as token lists, as bash would run them: variables assigned
    in the block (or before, in ``variables``) expanded, a for loop's commands once per value,
    read and arithmetic on the loop's values worked out. An unset variable stays as written
    ($ORIGINAL: a placeholder the prose explains, or a command's output). Tests (`[ ... ] &&
    continue`) are not evaluated: a loop's commands come for every value."""
    variables = {} if variables is None else variables
    yield from run_statements(list(statements(block)), variables)


def run_statements(commands, variables):
    """The commands of a statement list, for loops unrolled."""
    at = 0
    while at < len(commands):
        command = commands[at]
        at += 1
        if command[0] == "for" and command[2:3] == ["in"]:
            depth, start = 1, at
            while depth:
                depth += {"for": 1, "done": -1}.get(commands[at][0], 0)
                at += 1
            for value in expand_words(command[3:], variables):
                variables[command[1]] = value
                yield from run_statements(commands[start : at - 1], variables)
        elif command[0] != "done":
            yield from execute(command, variables)


def execute(command, variables):
    """One simple command: its assignments (NAME=WORD, NAME=(WORD ...)) or read set variables;
    any other command comes back expanded, with the assignments in front of it."""
    assignments = []
    while command and ENV_ASSIGNMENT.match(command[0]):
        name, value = command[0].split("=", 1)
        if value.startswith("("):  # NAME=(word ...)
            end = next(i for i, token in enumerate(command) if token.endswith(")"))
            words = [value[1:], *command[1 : end + 1]]
            words[-1] = words[-1][:-1]
            command = command[end + 1 :]
            variables[name] = expand_words([word for word in words if word], variables)
            continue
        assignments.append((name, value))
        command = command[1:]
    if command[:1] == ["read"]:  # IFS=C read -r NAME ... <<< WORD
        separator = dict(assignments).get("IFS", None)
        names = [token for token in command[1:-2] if not token.startswith("-")]
        values = expand(command[-1], variables).split(separator)
        variables.update(zip(names, values))
        return
    for name, value in assignments:
        if not command and "$(" not in value.replace("$((", ""):  # a command's output stays unset
            variables[name] = expand(value, variables)
    if command:
        yield [f"{name}={value}" for name, value in assignments] + expand_words(command, variables)


def expand(word, variables):
    """word with $NAME, ${NAME}, ${NAME[@]}, ${NAME[I]}, ${NAME%SUFFIX} and $((A op B)) expanded
    where their names are set."""

    def value(name):
        found = variables.get(name)
        return " ".join(found) if isinstance(found, list) else found

    def reference(m):
        name, index, suffix = m["name"] or m["plain"], m["index"], m["suffix"]
        if name not in variables:
            return m[0]
        found = variables[name]
        if index is not None:
            found = found if index == "@" else found[int(expand(index, variables))]
        found = " ".join(found) if isinstance(found, list) else found
        if suffix:  # the shortest suffix matching the pattern taken off
            cut = next((i for i in range(len(found), -1, -1) if fnmatch.fnmatchcase(found[i:], suffix)), len(found))
            found = found[:cut]
        return found

    def arithmetic(m):
        a, op, b = (value(x) if x in variables else x for x in (m[1], m[2], m[3]))
        if not (a.isdigit() and b.isdigit()):
            return m[0]
        return str(OPERATORS[op](int(a), int(b)))

    return REFERENCE.sub(reference, ARITHMETIC_WORD.sub(arithmetic, word))


def expand_words(words, variables):
    """The words after expansion, each word with an expansion split at whitespace (bash splits
    an unquoted expansion; the docs quote none that holds a space)."""
    out = []
    for word in words:
        expanded = expand(word, variables)
        out += expanded.split() if expanded != word else [word]
    return out


def readme_commands():
    return [command for block in bash_blocks(readme_text()) for command in split_commands(block) if command]


def invocation(tokens):
    """(what to run for --help, the repository file it runs or None, the arguments the README
    passes it) for a command that runs a repository script or a fairseq entry point, else None."""
    while tokens and ENV_ASSIGNMENT.match(tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return None
    program, rest = tokens[0], tokens[1:]
    if program in FAIRSEQ:
        return [program], None, rest
    if program in ("python", "python3", "bash"):
        if not rest or not REPO_SCRIPT.fullmatch(rest[0]):
            return None  # python -m pytest, python -c ...
        runner = [sys.executable] if program != "bash" else ["bash"]
        return [*runner, rest[0]], rest[0], rest[1:]
    if program == "sbatch":  # sbatch's own options come before the script
        at = next(i for i, token in enumerate(rest) if REPO_SCRIPT.fullmatch(token))
        return [rest[at]], rest[at], rest[at + 1 :]
    if REPO_SCRIPT.fullmatch(program):
        return [program], program, rest
    return None


def checked_commands():
    return [(tokens, found) for tokens in readme_commands() if (found := invocation(tokens))]


def command_id(tokens):
    return " ".join(tokens[:3])[:60]


@functools.cache
def run_help(argv):
    """Exit status and output of argv (a tuple), run from the repository root."""
    result = subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


def help_argv(run, args):
    """run + --help; a first bare word (`spm.sh train`, `finetune.sh sst_2`) stays in front,
    since a subcommand's options are in its own help; fairseq-train keeps the options that
    decide which options it has."""
    if run[0] == "fairseq-train":
        kept = [
            token for option, value in zip(args, args[1:]) if option in FAIRSEQ_SELECTORS for token in (option, value)
        ]
        return (*run, *kept, "--help")
    subcommand = args[:1] if args and re.fullmatch(r"[a-z][a-z0-9_]*", args[0]) else []
    return (*run, *subcommand, "--help")


def flags(args):
    return sorted({token.split("=", 1)[0] for token in args if token.startswith("--")})


def has_flag(flag, text):
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


COMMANDS = checked_commands()

# ---------------------------------------------------------------- parsed with the script's parser

# every page a user reads a command from
DOCS = (README, *sorted((REPO / "docs").rglob("*.md")), REPO / "data-prep" / "README.md")
# launchers whose --dry-run is cheap: the plan and the fairseq command, no training, no download
DRY_RUN = ("scripts/pretrain.sh", "scripts/slurm/pretrain.sbatch")
NOT_PARSED = {
    "scripts/quickstart.sh": "it has no --dry-run: it trains",
    "scripts/finetune.sh": "its --dry-run reads the checkpoint (k, sharing, sizes), which the docs only name",
    "scripts/slurm/finetune.sbatch": "its --dry-run is scripts/finetune.sh's, for each element",
    "scripts/fetch_minilm.sh": "it has no --dry-run: it downloads",
    "scripts/gpu_wheels.sh": "it has no --dry-run: it downloads",
    "scripts/gpu_check.sh": "it has no --dry-run: it needs a CUDA GPU",
}
FROM_NOT_PARSED = "--from: the launcher's --dry-run reads that checkpoint, which the docs only name"


def repository_command(tokens):
    """(the repository script a command runs, the arguments it passes) with environment
    assignments, python/python3/bash and sbatch with its own options taken off; None for any
    other command (pip, python -m pytest, fairseq-train). ``python -m dataprep.X`` is
    data-prep/X.sh, which runs just that."""
    while tokens and ENV_ASSIGNMENT.match(tokens[0]):
        tokens = tokens[1:]
    if tokens[:1] == ["sbatch"]:  # its own options (and their values) come before the script
        tokens = tokens[next((i for i, token in enumerate(tokens) if REPO_SCRIPT.fullmatch(token)), len(tokens)) :]
    elif tokens[:1] in (["python"], ["python3"], ["bash"]):
        tokens = tokens[1:]
        if tokens[:1] == ["-m"] and (module := re.fullmatch(r"dataprep\.(\w+)", tokens[1])):
            tokens = [f"data-prep/{module[1]}.sh", *tokens[2:]]
    if not tokens or not REPO_SCRIPT.fullmatch(tokens[0]):
        return None
    return tokens[0], tokens[1:]


def doc_commands():
    """(document, script, arguments) of each repository script's command in the docs, once each;
    a page's variables carry from one of its blocks to the next."""
    found = {}
    for doc in DOCS:
        variables = {}
        for block in bash_blocks(doc.read_text(encoding="utf-8")):
            for tokens in split_commands(block, variables):
                if command := repository_command(tokens):
                    script, args = command
                    found.setdefault((script, tuple(args)), doc.relative_to(REPO).as_posix())
    return [(doc, script, list(args)) for (script, args), doc in found.items()]


def entry_module(script):
    """The module whose parser a Python entry point runs: scripts/X.py and studies/X.py by their
    name (pytest's pythonpath), studies/X.sh (which execs studies/X.py) X, data-prep/X.sh
    `python -m dataprep.X`; None for a launcher."""
    path = Path(script)
    if path.suffix == ".py" or path.parts[0] == "studies" and (REPO / path.with_suffix(".py")).is_file():
        return path.stem
    return f"dataprep.{path.stem}" if path.parts[0] == "data-prep" else None


def way_of_checking(script, args):
    """'parse', 'dry-run', or why the command is not checked beyond --help."""
    if entry_module(script):
        return "parse"
    if script in DRY_RUN:
        return FROM_NOT_PARSED if "--from" in args else "dry-run"
    return NOT_PARSED.get(script, f"{script}: a launcher this test does not know; add it to DRY_RUN or NOT_PARSED")


def parse_error(module, args):
    """The error line of the module's parser (and of its check_required) on args; None if they parse."""
    parser, errors = module.build_parser(), io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parsed = parser.parse_args(args)
            if check := getattr(module, "check_required", None):
                check(parser, parsed)
    except SystemExit:
        return errors.getvalue().strip().splitlines()[-1]
    return None


DOC_COMMANDS = doc_commands()
PARSED = [c for c in DOC_COMMANDS if way_of_checking(*c[1:]) == "parse"]
DRY_RUNS = [c for c in DOC_COMMANDS if way_of_checking(*c[1:]) == "dry-run"]
# the launchers' commands neither parsed nor dry-run: their flags checked against --help
HELP_ONLY = [c for c in DOC_COMMANDS if way_of_checking(*c[1:]) not in ("parse", "dry-run")]


def all_doc_commands():
    """(document, tokens) of every command in the docs' bash blocks, variables expanded."""
    for doc in DOCS:
        variables = {}
        for block in bash_blocks(doc.read_text(encoding="utf-8")):
            for tokens in split_commands(block, variables):
                if tokens:
                    yield doc.relative_to(REPO).as_posix(), tokens


def path_words(tokens):
    """The words of a command that name a path: its arguments split at ':' (data-bin lists) and
    after '=' (task.data=...)."""
    for token in tokens:
        for word in token.split("=", 1)[-1].split(":"):
            if "/" in word:
                yield word


# what the README's pipeline writes under data-bin/ and checkpoints/ (data-prep's --destdir
# data-bin, the launchers' default --save-dir), besides what a docs command writes itself
PIPELINE_DATA_BIN = re.compile(r"data-bin(/pretrain(/shard\d+)?|/[A-Z][A-Za-z0-9-]*-bin(/.*)?)?/?")
PIPELINE_CHECKPOINTS = re.compile(r"checkpoints/((extend|finetune)(/.*)?|[\w.-]+\.pt)")


def doc_command_id(command):
    doc, script, args = command
    return f"{doc}:{script} {' '.join(args)}"[:80]


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes; the front door stays under {MAX_README_BYTES}"


def test_readme_has_no_machine_paths():
    """Commands use the repository's relative paths (work/..., OUT), not one machine's folders."""
    found = re.findall(r"(?<![\w.~-])/(?:work|root|home|tmp|mnt|scratch)/\S*", readme_text())
    assert not found, found


def test_readme_install_and_test_lines_are_what_ci_runs():
    """The README's install line, split at &&, is .ci/run's install steps in order, and CI runs the
    README's test command, adding only options that change what it prints."""
    commands = [" ".join(tokens) for tokens in readme_commands()]
    ci_lines = [line.strip() for line in CI.read_text(encoding="utf-8").splitlines()]

    readme_install = next(
        line
        for block in bash_blocks(readme_text())
        for line in block.splitlines()
        if line.startswith("pip install torch")
    )
    ci_install = [line for line in ci_lines if re.match(r"pip (install|uninstall) ", line)]
    assert [step.strip() for step in readme_install.split("&&")] == ci_install

    readme_test = [command for command in commands if command.startswith("python -m pytest")]
    assert readme_test == ["python -m pytest -n auto --dist loadfile"], readme_test
    ci_test = [line for line in ci_lines if line.startswith("python -m pytest")]
    assert len(ci_test) == 1, ci_test
    assert ci_test[0].startswith(readme_test[0] + " "), ci_test[0]
    extra = ci_test[0][len(readme_test[0]) :]
    assert re.fullmatch(r"( -q| -p no:cacheprovider| --durations=\d+)*", extra), f"CI adds {extra!r}"

    assert "bash scripts/quickstart.sh" in commands


def test_readme_names_repository_commands():
    """The parser finds the commands (a README that lost its code blocks would pass vacuously)."""
    scripts = {found[1] for _, found in COMMANDS if found[1]}
    assert {"scripts/quickstart.sh", "scripts/pretrain.sh", "scripts/finetune.sh"} <= scripts, scripts
    assert any(found[0] == ["fairseq-train"] for _, found in COMMANDS)


@pytest.mark.slow(minutes=3)  # the file's time: these, the docs' dry runs and their --help
@pytest.mark.parametrize(("tokens", "found"), COMMANDS, ids=[command_id(tokens) for tokens, _ in COMMANDS])
def test_readme_command_runs_with_help(tokens, found):
    run, script, args = found
    if script is not None:
        path = REPO / script
        assert path.is_file(), f"{script} (README: {' '.join(tokens)}) does not exist"
        if run[0] == script:
            assert os.access(path, os.X_OK), f"{script} is run directly in the README but is not executable"
    status, output = run_help(help_argv(run, args))
    assert status == 0, f"{' '.join(help_argv(run, args))} exited {status}:\n{output[-3000:]}"
    if run[0] == "fairseq-train":
        status, output = run_help((sys.executable, "-c", FAIRSEQ_TRAIN_PARSE, *args))
        assert status == 0, f"fairseq-train does not take the README's arguments:\n{output[-3000:]}"
    missing = [flag for flag in flags(args) if not has_flag(flag, output)]
    assert not missing, f"{' '.join(help_argv(run, args))} does not list {missing} (README: {' '.join(tokens)})"


@pytest.mark.slow(minutes=1)
def test_study_help_shows_path_defaults_from_the_checkout():
    """A study's --help names its default folders as any clone has them, not as this machine does,
    and no data outside the checkout: the data flags are required, and --help says so."""
    status, output = run_help((sys.executable, "studies/study_quality.py", "--help"))
    assert status == 0, output[-3000:]
    assert str(REPO) not in output, f"studies/study_quality.py --help prints this checkout's path:\n{output}"
    assert "(default: work/study)" in output and "../" not in output, output
    assert re.search(r"--wikitext WIKITEXT +folder with wiki.train.tokens and wiki.valid.tokens;\s+required", output)


def test_model_doc_flags_exist():
    """Every flag docs/model.md's flag tables name is one fairseq-train takes for the model."""
    text = MODEL_DOC.read_text(encoding="utf-8")
    tables = text.split("## Every model flag", 1)[1].split("\n## ", 1)[0]
    named = sorted(
        {
            flag
            for row in tables.splitlines()
            if row.startswith("| `--")
            for flag in re.findall(r"`(--[\w-]+)", row.split("|")[1])
        }
    )
    assert len(named) >= 30, named
    status, output = run_help(
        (
            sys.executable,
            "-c",
            FAIRSEQ_TRAIN_PARSE,
            "DATA",
            "--user-dir",
            "linformer_fairseq",
            "--arch",
            "linformer_roberta_base",
        )
    )
    assert status == 0, output[-3000:]
    missing = [flag for flag in named if not has_flag(flag, output)]
    assert not missing, f"docs/model.md names flags the model does not have: {missing}"


def test_docs_name_repository_commands():
    """The docs' commands are found (docs that lost their code blocks would pass vacuously), and
    each launcher is either dry-run or listed in NOT_PARSED with the reason."""
    assert {"scripts/linearize.py", "data-prep/spm.sh", "studies/study_quality.py"} <= {c[1] for c in PARSED}, PARSED
    assert DRY_RUNS, DOC_COMMANDS
    unknown = [c for c in DOC_COMMANDS if "does not know" in way_of_checking(*c[1:])]
    assert not unknown, unknown
    pages = {c[0] for c in DOC_COMMANDS}
    assert {"data-prep/README.md", "docs/linearize/report.md", "docs/long_documents/alternatives.md"} <= pages, pages


def test_split_commands_works_out_the_shell():
    """Commands come out as bash runs them: variables (across blocks), arrays, loops, read,
    arithmetic and suffix removal expanded; heredocs, redirections and comments left out."""
    variables = {}
    first = 'S="python scripts/a.py --x 1"  # a comment\nP=(scripts/b.sh --gpus 1)\n'
    assert list(split_commands(first, variables)) == []
    block = """for nk in 512,128 2048,256; do
  IFS=, read -r n k <<< "$nk"
  $S --n $n --k $((n / k)) > /dev/null
done
"${P[@]}" --save-dir work/${d%/*} \\
    data-bin/x
for w in a b; do for once in 0 1; do c=(--no-y --y); echo ${c[$once]} $w; done; done
python - $UNSET <<'PY'
print("not a command")
PY
"""
    variables["d"] = "one/two"
    assert [" ".join(c) for c in split_commands(block, variables)] == [
        "python scripts/a.py --x 1 --n 512 --k 4",
        "python scripts/a.py --x 1 --n 2048 --k 8",
        "scripts/b.sh --gpus 1 --save-dir work/one data-bin/x",
        "echo --no-y a",
        "echo --y a",
        "echo --no-y b",
        "echo --y b",
        "python - $UNSET",
    ]


@pytest.mark.parametrize("command", PARSED, ids=map(doc_command_id, PARSED))
def test_doc_command_parses(command):
    """A docs command of a Python script (scripts/*.py, studies/*.py and the studies/*.sh that
    exec them, data-prep/*.sh, which run ``python -m dataprep.X``) parses with the script's own
    parser, and passes its check_required (what argparse cannot require) where it has one: a
    missing argument or an unknown flag fails. Placeholders (DATA, work/..., OUT) are strings to
    argparse, so files are not checked."""
    doc, script, args = command
    error = parse_error(importlib.import_module(entry_module(script)), args)
    assert error is None, f"{doc}: {script} {' '.join(args)}\n{error}"


@pytest.mark.parametrize("command", DRY_RUNS, ids=map(doc_command_id, DRY_RUNS))
def test_doc_launcher_command_dry_runs(command):
    """A launcher's command in the docs runs with --dry-run (it plans and prints the fairseq
    command: a bad flag, config or override fails). Not run: scripts/pretrain.sh --from (its
    --dry-run reads that checkpoint, which the docs only name), and the launchers in NOT_PARSED:
    scripts/quickstart.sh (trains; no --dry-run), scripts/finetune.sh and slurm/finetune.sbatch
    (their --dry-run reads the checkpoint), scripts/fetch_minilm.sh (downloads; no --dry-run),
    scripts/gpu_check.sh (needs a CUDA GPU; no --dry-run), scripts/gpu_wheels.sh (downloads; no
    --dry-run). Their flags are checked against --help (test_doc_launcher_command_flags_exist)."""
    doc, script, args = command
    argv = [REPO / script, *([] if "--dry-run" in args else ["--dry-run"]), *args]
    done = subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{doc}: {script} {' '.join(args)}\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("command", HELP_ONLY, ids=map(doc_command_id, HELP_ONLY))
def test_doc_launcher_command_flags_exist(command):
    """A launcher's command that is neither parsed nor dry-run (NOT_PARSED, --from) runs with
    --help, and every flag it passes is one that --help lists."""
    doc, script, args = command
    assert (REPO / script).is_file(), f"{doc}: {script} does not exist"
    argv = help_argv([script if "/" in script else f"./{script}"], args)
    status, output = run_help(argv)
    assert status == 0, f"{' '.join(argv)} exited {status}:\n{output[-3000:]}"
    missing = [flag for flag in flags(args) if not has_flag(flag, output)]
    assert not missing, f"{doc}: {' '.join(argv)} does not list {missing} ({script} {' '.join(args)})"


def test_doc_commands_use_the_pipelines_paths():
    """A docs command names no machine's folders (absolute paths), and a path under data-bin/ or
    checkpoints/ is one the README's pipeline writes (data-bin/pretrain/shardN, data-bin/<TASK>-bin;
    checkpoints/<pretraining config>/, checkpoints/extend/, checkpoints/finetune/), one a docs
    command writes (a --destdir or --save-dir, a checkpoints/NAME.pt), or a placeholder the page
    names (DATA, CHECKPOINT, OUT, ...)."""
    commands = list(all_doc_commands())
    written = {
        value.rstrip("/")
        for _, tokens in commands
        for option, value in zip(tokens, tokens[1:])
        if option in ("--destdir", "--save-dir")
    }
    configs = {path.stem for path in (REPO / "configs" / "pretraining").glob("*.yaml")}
    wrong = []
    for doc, tokens in commands:
        for word in path_words(tokens):
            inside = any(word == folder or word.startswith(folder + "/") for folder in written)
            if word.startswith("/") and word != "/dev/null":
                wrong.append((doc, word))
            elif word.startswith("data-bin") and not (PIPELINE_DATA_BIN.fullmatch(word) or inside):
                wrong.append((doc, word))
            elif word.startswith("checkpoints/") and not (
                PIPELINE_CHECKPOINTS.fullmatch(word) or word.split("/")[1] in configs or inside
            ):
                wrong.append((doc, word))
    assert not wrong, f"paths the README's pipeline does not write (use its paths or a placeholder): {wrong}"
