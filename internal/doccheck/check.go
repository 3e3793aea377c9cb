package doccheck

import (
	"bytes"
	"errors"
	"fmt"
	"go/format"
	"go/scanner"
	"go/token"
	"go/types"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/tools/go/packages"
	"golang.org/x/tools/go/ssa"
	"golang.org/x/tools/go/ssa/ssautil"
)

// genDir is where, inside the module, the snippets' packages appear to
// the go command: only in the overlay Check hands it, never on disk.
const genDir = "internal/doccheck/snippets"

// NotGo lists the code blocks of doc comments that are not Go, by file
// (relative to the module root) and the start of the block's first line:
// formulas, wire formats, commands for other programs. The check fails
// closed: a block whose first line no longer starts so is checked as Go,
// and an entry that matches no block is reported, so the list cannot
// outlive what it describes. Blocks whose first line starts with "$ " (a
// shell command) need no entry.
var NotGo = map[string][]string{
	"cdc/checker.go":            {"fresh  ⇔  pg_last_wal_replay_lsn() >= source.lsn"},
	"feed/names.go":             {"ACL SETUSER caughtup-feed-pub ", "ACL SETUSER caughtup-feed-sub ", "ACL SETUSER caughtup-router "},
	"position/encode.go":        {"v1;<captured>;<database>="},
	"web/caughtuphttp/codec.go": {`base64url(payload) "." base64url(`, "1          version (valueVersion)"},
}

// commentsChecked reports whether the doc comments of the package in dir
// (relative to the module root, slash-separated) are checked: those of the
// library a user reads in go doc. Commands (package main: their comments
// are usage, in the shell), the test harnesses (testkit/), the lab
// (chaos/) and the programs under examples/ are not; their code is
// compiled as it is.
func commentsChecked(dir string) bool {
	for _, p := range []string{"testkit", "chaos", "examples", "cmd"} {
		if dir == p || strings.HasPrefix(dir, p+"/") {
			return false
		}
	}
	return true
}

// Find returns every Go snippet of the module rooted at root: the ```go
// blocks of its Markdown files and the code blocks of its library's doc
// comments (commentsChecked), with the problems found while reading them.
func Find(root string) ([]Snippet, []Problem, error) {
	var snippets []Snippet
	var problems []Problem
	notGoSeen := map[string]map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		name := d.Name()
		if d.IsDir() {
			if rel != "." && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata" || name == "node_modules") {
				return filepath.SkipDir
			}
			if rel != "." {
				if _, err := os.Stat(filepath.Join(p, "go.mod")); err == nil {
					return filepath.SkipDir // another module
				}
			}
			return nil
		}
		switch {
		case strings.HasSuffix(name, ".md"):
			src, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			s, probs := Markdown(rel, src)
			snippets = append(snippets, s...)
			problems = append(problems, probs...)
		case strings.HasSuffix(name, ".go") && !strings.HasSuffix(name, "_test.go"):
			if !commentsChecked(path.Dir(rel)) {
				return nil
			}
			src, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			if isMain(src) {
				return nil
			}
			s, probs, err := Comments(rel, src)
			if err != nil {
				return fmt.Errorf("%s: %w", rel, err)
			}
			problems = append(problems, probs...)
			for _, sn := range s {
				first, _, _ := strings.Cut(sn.Code, "\n")
				if prefix, ok := notGo(rel, first); ok {
					if notGoSeen[rel] == nil {
						notGoSeen[rel] = map[string]bool{}
					}
					notGoSeen[rel][prefix] = true
					continue
				}
				snippets = append(snippets, sn)
			}
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	for file, prefixes := range NotGo {
		for _, prefix := range prefixes {
			if !notGoSeen[file][prefix] {
				problems = append(problems, Problem{Pos: file, Msg: fmt.Sprintf("doccheck.NotGo names a block starting %q that is not there any more: remove the entry", prefix)})
			}
		}
	}
	return snippets, problems, nil
}

// notGo reports whether the block of file whose first line is first is
// listed in NotGo, and under which prefix.
func notGo(file, first string) (string, bool) {
	for _, prefix := range NotGo[file] {
		if strings.HasPrefix(first, prefix) {
			return prefix, true
		}
	}
	return "", false
}

// isMain reports whether a Go file's package clause says main.
func isMain(src []byte) bool {
	var sc scanner.Scanner
	fset := token.NewFileSet()
	sc.Init(fset.AddFile("", -1, len(src)), src, nil, 0)
	for {
		_, tok, lit := sc.Scan()
		switch tok {
		case token.EOF:
			return false
		case token.PACKAGE:
			_, tok, lit = sc.Scan()
			return tok == token.IDENT && lit == "main"
		}
	}
}

// Check compiles every snippet of the module rooted at root (Find) against
// the module, and reports each problem at the documentation's file and
// line: a block that is not a Go file's body, a compiler error, an error a
// call returns that nothing checks (assigned to _, overwritten before it
// is read, or dropped with the call's results), and a goroutine started on
// a function whose error it loses. It returns the number of snippets
// compiled.
func Check(root string) ([]Problem, int, error) {
	snippets, problems, err := Find(root)
	if err != nil {
		return nil, 0, err
	}
	more, err := CheckSnippets(root, snippets)
	if err != nil {
		return nil, 0, err
	}
	return append(problems, more...), len(snippets), nil
}

// CheckSnippets compiles snippets as packages of the module rooted at
// root, each its own package, and returns their problems.
func CheckSnippets(root string, snippets []Snippet) ([]Problem, error) {
	root, err := filepath.Abs(root)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(filepath.Join(root, genDir)); err == nil {
		return nil, fmt.Errorf("%s exists: the snippets' packages would collide with it", genDir)
	}
	var problems []Problem
	overlay := map[string][]byte{}
	var patterns []string
	for i, s := range snippets {
		abs := filepath.Join(root, filepath.FromSlash(s.File))
		src, err := Wrap(s, abs)
		if err != nil {
			problems = append(problems, syntaxProblems(root, s, err)...)
			continue
		}
		if line, ok := gofmted(s); !ok {
			problems = append(problems, Problem{Pos: fmt.Sprintf("%s:%d", s.File, line), Msg: "not formatted as gofmt formats it (from this line)"})
		}
		dir := fmt.Sprintf("%s/s%03d", genDir, i)
		overlay[filepath.Join(root, filepath.FromSlash(dir), "snippet.go")] = src
		patterns = append(patterns, "./"+dir)
	}
	if len(patterns) == 0 {
		return problems, nil
	}
	cfg := &packages.Config{
		Mode:    packages.LoadSyntax,
		Dir:     root,
		Overlay: overlay,
		Env:     append(os.Environ(), "GOWORK=off"),
	}
	pkgs, err := packages.Load(cfg, patterns...)
	if err != nil {
		return nil, err
	}
	rel := func(pos string) string {
		if r, ok := strings.CutPrefix(pos, root+string(filepath.Separator)); ok {
			return filepath.ToSlash(r)
		}
		return pos
	}
	var good []*packages.Package
	for _, p := range pkgs {
		if len(p.Errors) == 0 {
			good = append(good, p)
			continue
		}
		compiled := slices.ContainsFunc(p.Errors, func(e packages.Error) bool { return e.Kind != packages.ListError })
		for _, e := range p.Errors {
			if compiled && e.Kind == packages.ListError && strings.HasPrefix(e.Msg, "# ") {
				continue // the go command's copy of the type checker's errors
			}
			pos, msg := e.Pos, e.Msg
			if pos == "" {
				pos = p.PkgPath
			}
			problems = append(problems, Problem{Pos: rel(trimColumn(pos)), Msg: msg})
		}
	}
	for _, u := range uncheckedErrors(good) {
		u.Pos = rel(u.Pos)
		problems = append(problems, u)
	}
	slices.SortStableFunc(problems, func(a, b Problem) int { return strings.Compare(a.Pos, b.Pos) })
	return problems, nil
}

// trimColumn drops the column of a file:line:col position: a snippet's
// columns in a doc comment are not the file's.
func trimColumn(pos string) string {
	i := strings.LastIndexByte(pos, ':')
	j := strings.LastIndexByte(pos[:max(i, 0)], ':')
	if i < 0 || j < 0 {
		return pos
	}
	if strings.Trim(pos[i+1:], "0123456789") == "" && strings.Trim(pos[j+1:i], "0123456789") == "" {
		return pos[:i]
	}
	return pos
}

// syntaxProblems reports a snippet that does not parse as a Go file's body.
func syntaxProblems(root string, s Snippet, err error) []Problem {
	var list scanner.ErrorList
	if !errors.As(err, &list) {
		return []Problem{{Pos: s.Where(), Msg: err.Error()}}
	}
	var out []Problem
	for _, e := range list {
		pos := fmt.Sprintf("%s:%d", s.File, e.Pos.Line)
		msg := e.Msg
		if strings.Contains(msg, "non-declaration statement outside function body") || strings.HasPrefix(msg, "expected declaration") {
			msg += " (a snippet is a Go file's body: put statements in a function whose parameters name what they use)"
		}
		out = append(out, Problem{Pos: pos, Msg: msg})
	}
	return out
}

// errorType is the predeclared error interface.
var errorType = types.Universe.Lookup("error").Type().Underlying().(*types.Interface)

// uncheckedErrors finds, in pkgs' code, every error result of a call that
// nothing reads, and every goroutine whose function returns an error.
func uncheckedErrors(pkgs []*packages.Package) []Problem {
	if len(pkgs) == 0 {
		return nil
	}
	prog, ssaPkgs := ssautil.Packages(pkgs, ssa.BuilderMode(0))
	mine := map[*ssa.Package]bool{}
	for _, p := range ssaPkgs {
		if p != nil {
			p.Build()
			mine[p] = true
		}
	}
	var problems []Problem
	report := func(pos token.Pos, format string, args ...any) {
		problems = append(problems, Problem{
			Pos: fmt.Sprintf("%s:%d", prog.Fset.Position(pos).Filename, prog.Fset.Position(pos).Line),
			Msg: fmt.Sprintf(format, args...),
		})
	}
	for fn := range ssautil.AllFunctions(prog) {
		if fn.Pkg == nil || !mine[fn.Pkg] || fn.Blocks == nil {
			continue
		}
		for _, b := range fn.Blocks {
			for _, instr := range b.Instrs {
				switch in := instr.(type) {
				case *ssa.Call:
					if excused(&in.Call) {
						continue
					}
					for _, i := range errorResults(in.Call.Signature()) {
						if !resultUsed(in, i) {
							report(in.Pos(), "the error %s returns is not checked", callName(&in.Call))
						}
					}
				case *ssa.Go:
					if len(errorResults(in.Call.Signature())) > 0 {
						report(in.Pos(), "go %s loses the error it returns: run it where the error is checked (an errgroup, a channel)", callName(&in.Call))
					}
				}
			}
		}
	}
	return problems
}

// errorResults returns the indexes of sig's results that are errors.
func errorResults(sig *types.Signature) []int {
	var idx []int
	for i := range sig.Results().Len() {
		t := sig.Results().At(i).Type()
		if types.IsInterface(t) && types.Implements(t, errorType) || types.Identical(t, errorType) {
			idx = append(idx, i)
		}
	}
	return idx
}

// resultUsed reports whether result i of call is read by anything.
func resultUsed(call *ssa.Call, i int) bool {
	if call.Call.Signature().Results().Len() == 1 {
		return valueUsed(call, map[ssa.Value]bool{})
	}
	for _, r := range *call.Referrers() {
		if ex, ok := r.(*ssa.Extract); ok && ex.Index == i && valueUsed(ex, map[ssa.Value]bool{}) {
			return true
		}
	}
	return false
}

// valueUsed reports whether v is read by an instruction other than a φ
// whose own value nothing reads.
func valueUsed(v ssa.Value, seen map[ssa.Value]bool) bool {
	if seen[v] {
		return false
	}
	seen[v] = true
	refs := v.Referrers()
	if refs == nil {
		return false
	}
	for _, r := range *refs {
		if phi, ok := r.(*ssa.Phi); ok {
			if valueUsed(phi, seen) {
				return true
			}
			continue
		}
		return true
	}
	return false
}

// excused reports whether a call's error may go unchecked: fmt's printing
// to standard output, whose error no program checks.
func excused(c *ssa.CallCommon) bool {
	f := c.StaticCallee()
	if f == nil || f.Pkg == nil || f.Pkg.Pkg.Path() != "fmt" {
		return false
	}
	switch f.Name() {
	case "Print", "Printf", "Println":
		return true
	}
	return false
}

// callName names a call's function for a message.
func callName(c *ssa.CallCommon) string {
	if f := c.StaticCallee(); f != nil {
		return strings.TrimPrefix(f.String(), "")
	}
	if c.IsInvoke() {
		return c.Method.FullName()
	}
	var buf bytes.Buffer
	buf.WriteString(c.Value.String())
	return buf.String()
}

// gofmted reports whether s's code is as gofmt formats it, and if not the
// line of s.File where they first differ.
func gofmted(s Snippet) (int, bool) {
	head := ""
	if !startsWithPackage(s.Code) {
		head = "package " + defaultPackage + "\n"
	}
	out, err := format.Source([]byte(head + s.Code))
	if err != nil {
		return s.Line, true // a syntax error is reported as such
	}
	got := strings.Split(strings.TrimLeft(strings.TrimPrefix(string(out), head), "\n"), "\n")
	want := strings.Split(s.Code, "\n")
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			return s.Line + i, false
		}
	}
	if len(got) != len(want) {
		return s.Line + min(len(got), len(want)), false
	}
	return 0, true
}
