// Package deploy_test checks the Grafana dashboard and the Prometheus
// alert rules in deploy/ against the code: every metric they query is an
// instrument caughtup creates, named as an OpenTelemetry Prometheus
// exporter names it, every label they use is an attribute caughtup sets,
// and promtool accepts the rules.
package deploy_test

import (
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

// instrument is one metric instrument the product creates.
type instrument struct {
	name, unit, kind string // kind: the Meter method, e.g. Int64Counter
	at               string
}

// productSources walks the module's product packages: not the lab, the
// test harnesses, examples, commands or tests.
func productSources(t *testing.T, visit func(path string, f *ast.File)) {
	t.Helper()
	root := ".."
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch strings.Split(rel, string(filepath.Separator))[0] {
			case "chaos", "testkit", "examples", "cmd", "deploy", "docs", ".git":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		visit(rel, f)
		return nil
	})
	require.NoError(t, err)
}

var instrumentMethod = regexp.MustCompile(`^(Int64|Float64)(Counter|UpDownCounter|Histogram|Gauge|ObservableCounter|ObservableUpDownCounter|ObservableGauge)$`)

// instruments are the calls meter.Int64Counter("caughtup…", …,
// metric.WithUnit("…")) and the like in the product's sources.
func instruments(t *testing.T) []instrument {
	var out []instrument
	productSources(t, func(path string, f *ast.File) {
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok || len(call.Args) == 0 {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok || !instrumentMethod.MatchString(sel.Sel.Name) {
				return true
			}
			lit, ok := call.Args[0].(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				return true
			}
			name, _ := strconv.Unquote(lit.Value)
			if !strings.HasPrefix(name, "caughtup.") {
				return true
			}
			in := instrument{name: name, kind: sel.Sel.Name, at: path}
			for _, a := range call.Args[1:] {
				if c, ok := a.(*ast.CallExpr); ok {
					if s, ok := c.Fun.(*ast.SelectorExpr); ok && s.Sel.Name == "WithUnit" && len(c.Args) == 1 {
						if l, ok := c.Args[0].(*ast.BasicLit); ok {
							in.unit, _ = strconv.Unquote(l.Value)
						}
					}
				}
			}
			out = append(out, in)
			return true
		})
	})
	return out
}

// promNames are the series names an OTel Prometheus exporter gives an
// instrument (the OpenTelemetry compatibility specification, underscore
// escaping with suffixes): dots to underscores; the unit as a suffix ("s"
// seconds, "By" bytes, "1" ratio on what is not a counter; annotations in
// braces dropped); _total on monotonic counters; a histogram's _bucket,
// _sum and _count.
func promNames(in instrument) []string {
	name := strings.ReplaceAll(in.name, ".", "_")
	counter := strings.HasSuffix(in.kind, "Counter") && !strings.Contains(in.kind, "UpDown")
	switch in.unit {
	case "s":
		name += "_seconds"
	case "By":
		name += "_bytes"
	case "1":
		if !counter {
			name += "_ratio"
		}
	}
	switch {
	case counter:
		return []string{name + "_total"}
	case strings.HasSuffix(in.kind, "Histogram"):
		return []string{name + "_bucket", name + "_sum", name + "_count"}
	}
	return []string{name}
}

var attributeKey = regexp.MustCompile(`^(caughtup|messaging|error)\.[a-z_.]+$`)

// attributeKeys are the product's string literals that name attributes
// ("caughtup.reason"), as Prometheus labels ("caughtup_reason").
func attributeKeys(t *testing.T) map[string]bool {
	keys := map[string]bool{}
	productSources(t, func(_ string, f *ast.File) {
		ast.Inspect(f, func(n ast.Node) bool {
			if lit, ok := n.(*ast.BasicLit); ok && lit.Kind == token.STRING {
				if s, err := strconv.Unquote(lit.Value); err == nil && attributeKey.MatchString(s) {
					keys[strings.ReplaceAll(s, ".", "_")] = true
				}
			}
			return true
		})
	})
	return keys
}

// queries are the dashboard's target expressions and the rules' exprs.
func queries(t *testing.T) map[string][]string {
	out := map[string][]string{}
	b, err := os.ReadFile("grafana/caughtup.json")
	require.NoError(t, err)
	var dash struct {
		Title  string `json:"title"`
		Panels []struct {
			Type        string `json:"type"`
			Title       string `json:"title"`
			Description string `json:"description"`
			Targets     []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	require.NoError(t, json.Unmarshal(b, &dash), "the dashboard is JSON")
	require.NotEmpty(t, dash.Title)
	for _, p := range dash.Panels {
		if p.Type == "row" {
			continue
		}
		require.NotEmpty(t, p.Description, "panel %q says what it means", p.Title)
		require.NotEmpty(t, p.Targets, "panel %q queries something", p.Title)
		for _, tg := range p.Targets {
			out["dashboard panel "+p.Title] = append(out["dashboard panel "+p.Title], tg.Expr)
		}
	}
	b, err = os.ReadFile("prometheus/caughtup-alerts.yml")
	require.NoError(t, err)
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Expr        string            `yaml:"expr"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	require.NoError(t, yaml.Unmarshal(b, &rules))
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			require.NotEmpty(t, r.Annotations["description"], "alert %s says what it means", r.Alert)
			out["alert "+r.Alert] = append(out["alert "+r.Alert], r.Expr)
		}
	}
	require.NotEmpty(t, out)
	return out
}

var (
	metricRef = regexp.MustCompile(`\bcaughtup_[a-z0-9_]+`)
	// Label names in selectors ({name=…, name!~…}) and in by/without
	// clauses.
	selectorBody = regexp.MustCompile(`\{([^}]*)\}`)
	selectorKey  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)`)
	grouping     = regexp.MustCompile(`\b(?:by|without)\s*\(([^)]*)\)`)
)

// Labels every Prometheus series has, or a histogram's bucket bound.
var standardLabels = []string{"job", "instance", "le"}

func TestDashboardAndAlertsQueryWhatCaughtupExports(t *testing.T) {
	exported := map[string]instrument{}
	for _, in := range instruments(t) {
		for _, n := range promNames(in) {
			exported[n] = in
		}
	}
	require.Greater(t, len(exported), 30, "the instruments were found in the sources")
	labels := attributeKeys(t)
	require.True(t, labels["caughtup_reason"], "attribute keys were found in the sources")

	used := map[string]bool{}
	for where, exprs := range queries(t) {
		for _, e := range exprs {
			// Metric names outside label selectors and grouping clauses,
			// where caughtup_… are labels.
			bare := grouping.ReplaceAllString(selectorBody.ReplaceAllString(e, "{}"), "")
			refs := metricRef.FindAllString(bare, -1)
			require.NotEmpty(t, refs, "%s: %q queries no caughtup metric", where, e)
			for _, m := range refs {
				_, ok := exported[m]
				require.True(t, ok, "%s queries %s, which caughtup does not export (instruments: %v)", where, m, sortedKeys(exported))
				used[m] = true
			}
			var keys []string
			for _, body := range selectorBody.FindAllStringSubmatch(e, -1) {
				for _, k := range selectorKey.FindAllStringSubmatch(body[1], -1) {
					keys = append(keys, k[1])
				}
			}
			for _, g := range grouping.FindAllStringSubmatch(e, -1) {
				for k := range strings.SplitSeq(g[1], ",") {
					if k = strings.TrimSpace(k); k != "" {
						keys = append(keys, k)
					}
				}
			}
			for _, k := range keys {
				require.True(t, labels[k] || slices.Contains(standardLabels, k), "%s: label %s in %q is no attribute caughtup sets", where, k, e)
			}
		}
	}
	t.Logf("%d of %d exported series names queried", len(used), len(exported))
}

func TestPromtoolAcceptsTheRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	// Never a silent skip: make test's deps install it.
	require.NoError(t, err, "promtool is not installed (Debian: apt-get install prometheus; scripts/install-deps does)")
	out, err := exec.Command(promtool, "check", "rules", "prometheus/caughtup-alerts.yml").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "SUCCESS")
}

func sortedKeys(m map[string]instrument) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
