package doccheck

import (
	"bufio"
	"bytes"
	"fmt"
	"go/ast"
	"go/doc/comment"
	"go/parser"
	"go/token"
	"strings"
)

// A Snippet is one block of Go code found in documentation.
type Snippet struct {
	// File is the path of the file the block is in, as given to the
	// extractor (relative to the module root when Check found it).
	File string
	// Line is the line of File that holds the block's first line.
	Line int
	// Code is the block's text, its common indentation removed; its line i
	// (from 0) is File's line Line+i.
	Code string
}

// Where names the snippet's first line, as file:line.
func (s Snippet) Where() string { return fmt.Sprintf("%s:%d", s.File, s.Line) }

// A Problem is something wrong with the documentation at Pos (file:line).
type Problem struct {
	Pos string
	Msg string
}

func (p Problem) String() string { return p.Pos + ": " + p.Msg }

// Markdown returns the fenced code blocks of a Markdown document whose
// language is go. A fence must name its language (```go, ```sh,
// ```text …): a bare fence is reported as a problem, so that a Go block
// cannot slip past the check by leaving its language out.
func Markdown(file string, src []byte) ([]Snippet, []Problem) {
	var (
		snippets []Snippet
		problems []Problem
		inBlock  bool
		isGo     bool
		fence    string
		start    int
		code     strings.Builder
		indent   int
	)
	sc := bufio.NewScanner(bytes.NewReader(src))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		trimmed := strings.TrimLeft(line, " ")
		if !inBlock {
			ind := len(line) - len(trimmed)
			if ind > 3 {
				continue
			}
			mark := fenceMark(trimmed)
			if mark == "" {
				continue
			}
			info := strings.TrimSpace(trimmed[len(mark):])
			lang, _, _ := strings.Cut(info, " ")
			if lang == "" {
				problems = append(problems, Problem{
					Pos: fmt.Sprintf("%s:%d", file, n),
					Msg: "fenced code block without a language: name it (```go is compiled by the doc check; ```sh, ```text, ```sql … are not)",
				})
			}
			inBlock, isGo, fence, start, indent = true, lang == "go", mark, n+1, ind
			code.Reset()
			continue
		}
		if ind := len(line) - len(trimmed); ind <= 3 && strings.HasPrefix(trimmed, fence) && strings.TrimSpace(strings.TrimLeft(trimmed, fence[:1])) == "" {
			if isGo {
				snippets = append(snippets, Snippet{File: file, Line: start, Code: code.String()})
			}
			inBlock = false
			continue
		}
		// A fence indented by k spaces removes up to k spaces from each line.
		for i := 0; i < indent && strings.HasPrefix(line, " "); i++ {
			line = line[1:]
		}
		code.WriteString(line)
		code.WriteByte('\n')
	}
	if inBlock {
		problems = append(problems, Problem{Pos: fmt.Sprintf("%s:%d", file, start-1), Msg: "code block not closed"})
	}
	return snippets, problems
}

// fenceMark returns the run of three or more backticks or tildes that
// opens line, or "".
func fenceMark(line string) string {
	for _, c := range []byte{'`', '~'} {
		n := 0
		for n < len(line) && line[n] == c {
			n++
		}
		if n >= 3 {
			if c == '`' && strings.Contains(line[n:], "`") {
				return "" // an inline code span, not a fence
			}
			return line[:n]
		}
	}
	return ""
}

// Comments returns the code blocks of the doc comments in a Go source
// file: the package comment and those of every declaration, method and
// field. Every code block of a doc comment is Go except one whose first
// line starts with "$ " (a shell command): write output and other text as
// prose or as a list.
func Comments(file string, src []byte) ([]Snippet, []Problem, error) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, file, src, parser.ParseComments|parser.SkipObjectResolution)
	if err != nil {
		return nil, nil, err
	}
	var snippets []Snippet
	var problems []Problem
	for _, cg := range docComments(f) {
		s, p := commentBlocks(fset, file, cg)
		snippets = append(snippets, s...)
		problems = append(problems, p...)
	}
	return snippets, problems, nil
}

// docComments lists the doc comments of f: the package's and those of its
// declarations, their specs, methods and fields.
func docComments(f *ast.File) []*ast.CommentGroup {
	var docs []*ast.CommentGroup
	add := func(cg *ast.CommentGroup) {
		if cg != nil {
			docs = append(docs, cg)
		}
	}
	add(f.Doc)
	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.FuncDecl:
			add(n.Doc)
			return false // no doc comments inside bodies
		case *ast.GenDecl:
			add(n.Doc)
		case *ast.TypeSpec:
			add(n.Doc)
		case *ast.ValueSpec:
			add(n.Doc)
		case *ast.Field:
			add(n.Doc)
		}
		return true
	})
	return docs
}

// commentBlocks returns the code blocks of one doc comment, each with the
// line it starts on.
func commentBlocks(fset *token.FileSet, file string, cg *ast.CommentGroup) ([]Snippet, []Problem) {
	// The comment's lines after their markers, each with its line number,
	// as go/doc/comment sees them (ast.CommentGroup.Text's rules: "//" and
	// one space removed; a /* */ comment is not split).
	type line struct {
		n    int
		text string
	}
	var lines []line
	for _, c := range cg.List {
		if !strings.HasPrefix(c.Text, "//") {
			return nil, nil // a /* */ block: doc comments here use //
		}
		if strings.HasPrefix(c.Text, "//go:") || strings.HasPrefix(c.Text, "//line ") {
			continue // directives are not part of the text
		}
		t := strings.TrimPrefix(c.Text[2:], " ")
		lines = append(lines, line{n: fset.Position(c.Pos()).Line, text: t})
	}
	var text strings.Builder
	for _, l := range lines {
		text.WriteString(l.text)
		text.WriteByte('\n')
	}
	var p comment.Parser
	doc := p.Parse(text.String())
	var snippets []Snippet
	var problems []Problem
	next := 0 // index in lines where the search for the next block starts
	for _, b := range doc.Content {
		code, ok := b.(*comment.Code)
		if !ok {
			continue
		}
		first, _, _ := strings.Cut(code.Text, "\n")
		first = strings.TrimSpace(first)
		at := -1
		for i := next; i < len(lines); i++ {
			if strings.TrimSpace(lines[i].text) == first && strings.TrimSpace(lines[i].text) != "" {
				at = i
				break
			}
		}
		if at < 0 {
			problems = append(problems, Problem{
				Pos: fmt.Sprintf("%s:%d", file, fset.Position(cg.Pos()).Line),
				Msg: "cannot find the lines of a code block in its comment",
			})
			continue
		}
		next = at + strings.Count(strings.TrimRight(code.Text, "\n"), "\n") + 1
		if strings.HasPrefix(first, "$ ") {
			continue // a shell command
		}
		snippets = append(snippets, Snippet{File: file, Line: lines[at].n, Code: code.Text})
	}
	return snippets, problems
}
