package foreigntask_test

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"testing"

	"github.com/hibiken/asynq"
	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/caughtup/caughtup/asynq/caughtupasynq"
	"github.com/caughtup/caughtup/asynq/caughtupasynq/foreigntask"
)

// TestSample runs the analyzer on testdata/sample, a module that uses
// the real asynq and this checkout's caughtupasynq, and checks every
// diagnostic and fact its // want comments name.
func TestSample(t *testing.T) {
	root, err := filepath.Abs("../../..")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	copyTree(t, "testdata/sample", dir)
	// The sample's replace directive points at this checkout wherever the
	// copy is; its go.sum is the module's, and go may add the indirect
	// requirements (from the module cache: no network).
	mod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	mod = regexp.MustCompile(`(?m)^replace github.com/caughtup/caughtup => .*$`).
		ReplaceAll(mod, []byte("replace github.com/caughtup/caughtup => "+root))
	writeFile(t, filepath.Join(dir, "go.mod"), mod)
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "go.sum"), sum)
	t.Setenv("GOFLAGS", "-mod=mod")
	analysistest.Run(t, dir, foreigntask.Analyzer, "./...")
}

// TestClientMethods checks that ClientMethods are exactly the methods of
// *caughtupasynq.Client that take a task: a method added to the client
// must be added to the analyzer.
func TestClientMethods(t *testing.T) {
	taskType := reflect.TypeFor[*asynq.Task]()
	var takeTask []string
	client := reflect.TypeFor[*caughtupasynq.Client]()
	for m := range client.Methods() {
		for in := range m.Type.Ins() {
			if in == taskType {
				takeTask = append(takeTask, m.Name)
				break
			}
		}
	}
	slices.Sort(takeTask)
	want := slices.Sorted(slices.Values(foreigntask.ClientMethods))
	if !slices.Equal(takeTask, want) {
		t.Errorf("methods of *caughtupasynq.Client that take an *asynq.Task: %v; foreigntask.ClientMethods: %v", takeTask, want)
	}
}

func copyTree(t *testing.T, from, to string) {
	t.Helper()
	err := filepath.WalkDir(from, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(from, p)
		if err != nil {
			return err
		}
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(to, rel), 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(to, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
}

func writeFile(t *testing.T, name string, b []byte) {
	t.Helper()
	if err := os.WriteFile(name, b, 0o644); err != nil {
		t.Fatal(err)
	}
}
