package doccheck

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/scanner"
	"go/token"
	"path"
	"slices"
	"strconv"
	"strings"
)

// Imports is the package each name stands for in a snippet that uses it
// without importing it: what a reader would import, so that a snippet can
// show only the lines that matter. A snippet that imports a path itself
// keeps its import. The kafka name is kafka-go's: a snippet about
// caughtup's own package kafka imports it under a name.
var Imports = map[string]string{
	// The standard library.
	"context":  "context",
	"errors":   "errors",
	"fmt":      "fmt",
	"http":     "net/http",
	"io":       "io",
	"log":      "log",
	"maps":     "maps",
	"os":       "os",
	"signal":   "os/signal",
	"slices":   "slices",
	"slog":     "log/slog",
	"sql":      "database/sql",
	"strconv":  "strconv",
	"strings":  "strings",
	"sync":     "sync",
	"syscall":  "syscall",
	"time":     "time",
	"json":     "encoding/json",
	"errgroup": "golang.org/x/sync/errgroup",

	// The libraries caughtup works with.
	"asynq":       "github.com/hibiken/asynq",
	"kafka":       "github.com/segmentio/kafka-go",
	"kgo":         "github.com/twmb/franz-go/pkg/kgo",
	"pgx":         "github.com/jackc/pgx/v5",
	"pgconn":      "github.com/jackc/pgx/v5/pgconn",
	"pgxpool":     "github.com/jackc/pgx/v5/pgxpool",
	"pglogrepl":   "github.com/jackc/pglogrepl",
	"redis":       "github.com/redis/go-redis/v9",
	"river":       "github.com/riverqueue/river",
	"riverpgxv5":  "github.com/riverqueue/river/riverdriver/riverpgxv5",
	"rivertype":   "github.com/riverqueue/river/rivertype",
	"otel":        "go.opentelemetry.io/otel",
	"propagation": "go.opentelemetry.io/otel/propagation",

	// caughtup.
	"caughtupasynq": "github.com/caughtup/caughtup/asynq/caughtupasynq",
	"caughtuphttp":  "github.com/caughtup/caughtup/web/caughtuphttp",
	"caughtupkafka": "github.com/caughtup/caughtup/kafka/caughtupkafka",
	"caughtupkgo":   "github.com/caughtup/caughtup/kafka/caughtupkgo",
	"caughtupriver": "github.com/caughtup/caughtup/river/caughtupriver",
	"cdc":           "github.com/caughtup/caughtup/cdc",
	"consume":       "github.com/caughtup/caughtup/consume",
	"enqueue":       "github.com/caughtup/caughtup/enqueue",
	"feed":          "github.com/caughtup/caughtup/feed",
	"outbox":        "github.com/caughtup/caughtup/outbox",
	"pgwal":         "github.com/caughtup/caughtup/internal/pgwal",
	"position":      "github.com/caughtup/caughtup/position",
	"replay":        "github.com/caughtup/caughtup/replay",
	"replicapool":   "github.com/caughtup/caughtup/replicapool",
	"sign":          "github.com/caughtup/caughtup/sign",
}

// importName is the name a snippet's import of path binds: its own name,
// else the name Imports gives the path, else the path's last element
// without a version suffix or a "go-" or "-go" (kafka-go is kafka).
func importName(spec *ast.ImportSpec) string {
	p, err := strconv.Unquote(spec.Path.Value)
	if err != nil {
		return ""
	}
	if spec.Name != nil {
		return spec.Name.Name
	}
	for name, ip := range Imports {
		if ip == p {
			return name
		}
	}
	elem := path.Base(p)
	if len(elem) > 1 && elem[0] == 'v' && strings.Trim(elem[1:], "0123456789") == "" {
		elem = path.Base(path.Dir(p))
	}
	elem = strings.TrimPrefix(strings.TrimSuffix(elem, "-go"), "go-")
	return strings.ReplaceAll(elem, "-", "")
}

// defaultPackage is the package clause of a snippet that has none.
const defaultPackage = "snippet"

// Wrap turns a snippet into the source of a Go file: the snippet itself,
// with a package clause when it has none and an import for every package
// name of Imports it uses without importing, and line directives that
// give every line of the snippet its place in s.File (written as
// fileName), so that compiler errors name the documentation's lines.
//
// A snippet is what may follow a package clause: imports and
// declarations. Statements go in a function, whose parameters say what
// they take: a snippet names every value it uses, so that a reader can
// copy it.
func Wrap(s Snippet, fileName string) ([]byte, error) {
	code := s.Code
	hasPackage := startsWithPackage(code)
	var head string
	if !hasPackage {
		head = "package " + defaultPackage + "\n"
	}
	directive := func(line int) string { return fmt.Sprintf("//line %s:%d\n", fileName, line) }

	// Parse once as written, for syntax errors at the documentation's
	// lines and the names the snippet leaves to Imports.
	src := head + directive(s.Line) + code
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "", src, parser.ParseComments)
	if err != nil {
		return nil, err
	}
	missing := missingImports(f)
	if len(missing) == 0 {
		return []byte(src), nil
	}
	var imports strings.Builder
	imports.WriteString("import (\n")
	for _, p := range missing {
		fmt.Fprintf(&imports, "\t%q\n", p)
	}
	imports.WriteString(")\n")
	if !hasPackage {
		return []byte(head + imports.String() + directive(s.Line) + code), nil
	}
	// After the snippet's own package clause: split the code after the
	// clause's line and resume the directive's count there.
	pkgLine := fset.PositionFor(f.Name.End(), false).Line - 1 // lines of src before the clause's last: the directive
	lines := strings.SplitAfter(code, "\n")
	before := strings.Join(lines[:pkgLine], "")
	after := strings.Join(lines[pkgLine:], "")
	return []byte(directive(s.Line) + before + imports.String() + directive(s.Line+pkgLine) + after), nil
}

// startsWithPackage reports whether the first token of code, comments
// aside, is the package keyword.
func startsWithPackage(code string) bool {
	var sc scanner.Scanner
	fset := token.NewFileSet()
	file := fset.AddFile("", -1, len(code))
	sc.Init(file, []byte(code), nil, 0)
	_, tok, _ := sc.Scan()
	return tok == token.PACKAGE
}

// missingImports returns the import paths of the names of Imports that f
// uses as packages (the left of a selector) without declaring or
// importing them, sorted.
func missingImports(f *ast.File) []string {
	have := map[string]bool{}
	for _, spec := range f.Imports {
		have[importName(spec)] = true
	}
	unresolved := map[*ast.Ident]bool{}
	for _, id := range f.Unresolved {
		unresolved[id] = true
	}
	var paths []string
	ast.Inspect(f, func(n ast.Node) bool {
		sel, ok := n.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		id, ok := sel.X.(*ast.Ident)
		if !ok || !unresolved[id] || have[id.Name] {
			return true
		}
		if p, ok := Imports[id.Name]; ok {
			have[id.Name] = true
			paths = append(paths, p)
		}
		return true
	})
	slices.Sort(paths)
	return paths
}
