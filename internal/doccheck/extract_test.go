package doccheck

import (
	"slices"
	"strings"
	"testing"
)

func TestMarkdown(t *testing.T) {
	src := strings.Join([]string{
		"# Title",                   // 1
		"",                          // 2
		"```go",                     // 3
		"func f() {}",               // 4
		"```",                       // 5
		"```sh",                     // 6
		"make test",                 // 7
		"```",                       // 8
		"```",                       // 9: no language
		"a diagram",                 // 10
		"```",                       // 11
		"  ```go title",             // 12: indented, with more info
		"  func g() {",              // 13
		"  \tprintln()",             // 14
		"  }",                       // 15
		"  ```",                     // 16
		"Inline ```go``` is prose.", // 17
		"````go",                    // 18
		"```",                       // 19: shorter than the fence: code
		"````",                      // 20
		"```go",                     // 21
		"unclosed",                  // 22
	}, "\n") + "\n"
	snippets, problems := Markdown("x.md", []byte(src))
	want := []Snippet{
		{File: "x.md", Line: 4, Code: "func f() {}\n"},
		{File: "x.md", Line: 13, Code: "func g() {\n\tprintln()\n}\n"},
		{File: "x.md", Line: 19, Code: "```\n"},
	}
	if !slices.Equal(snippets, want) {
		t.Errorf("snippets:\n%+v\nwant\n%+v", snippets, want)
	}
	var pos []string
	for _, p := range problems {
		pos = append(pos, p.Pos)
	}
	if !slices.Equal(pos, []string{"x.md:9", "x.md:21"}) {
		t.Errorf("problems at %v, want x.md:9 (no language) and x.md:21 (not closed): %v", pos, problems)
	}
}

func TestComments(t *testing.T) {
	src := `// Package p does things.
//
//	func A() {}
//
// A list is not code:
//   - one
//   - two
//
// A shell command is not Go:
//
//	$ go vet ./...
package p

// B is documented with a block of two paragraphs.
//
//	x := 1
//
//	y := 2
func B() {}

type T struct {
	// F has a block too.
	//
	//	var f int
	F int
}

func c() {
	// Not a doc comment:
	//
	//	nothing
}
`
	snippets, problems, err := Comments("p.go", []byte(src))
	if err != nil {
		t.Fatal(err)
	}
	if len(problems) > 0 {
		t.Errorf("problems: %v", problems)
	}
	want := []Snippet{
		{File: "p.go", Line: 3, Code: "func A() {}\n"},
		{File: "p.go", Line: 16, Code: "x := 1\n\ny := 2\n"},
		{File: "p.go", Line: 24, Code: "var f int\n"},
	}
	if !slices.Equal(snippets, want) {
		t.Errorf("snippets:\n%+v\nwant\n%+v", snippets, want)
	}
}

func TestWrap(t *testing.T) {
	for _, tc := range []struct {
		name string
		code string
		want []string // lines the wrapped source must contain, in order
	}{{
		name: "declarations get a package clause and imports",
		code: "func f(ctx context.Context) error {\n\treturn consume.ErrNotRouted\n}\n",
		want: []string{"package snippet", `"context"`, `"github.com/caughtup/caughtup/consume"`, "//line /doc.md:10", "func f(ctx context.Context) error {"},
	}, {
		name: "a snippet's own imports are kept, the rest added",
		code: "import \"github.com/segmentio/kafka-go\"\n\nvar m kafka.Message\nvar c consume.Policy\n",
		want: []string{"package snippet", `"github.com/caughtup/caughtup/consume"`, "//line /doc.md:10", `import "github.com/segmentio/kafka-go"`},
	}, {
		name: "a package clause of its own: imports after it, lines resumed",
		code: "// A program.\npackage main\n\nfunc main() { fmt.Println() }\n",
		want: []string{"//line /doc.md:10", "package main", `"fmt"`, "//line /doc.md:12", "func main() { fmt.Println() }"},
	}, {
		name: "local names are not packages",
		code: "func f(consume int) int { return consume.x }\n",
		want: []string{"package snippet", "//line /doc.md:10", "func f("},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			src, err := Wrap(Snippet{File: "doc.md", Line: 10, Code: tc.code}, "/doc.md")
			if err != nil {
				t.Fatal(err)
			}
			rest := string(src)
			for _, w := range tc.want {
				i := strings.Index(rest, w)
				if i < 0 {
					t.Fatalf("%q not found in order in:\n%s", w, src)
				}
				rest = rest[i+len(w):]
			}
			if tc.name == "local names are not packages" && strings.Contains(string(src), "import") {
				t.Errorf("imported a package for a local name:\n%s", src)
			}
		})
	}
}
