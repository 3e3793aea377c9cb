package doccheck

import (
	"strings"
	"testing"
)

// TestCheckSnippets feeds the checker snippets with each kind of mistake
// and one without, and expects each mistake at its documentation line.
func TestCheckSnippets(t *testing.T) {
	snippets := []Snippet{{
		File: "good.md", Line: 1,
		Code: `func run(ctx context.Context, pool *pgxpool.Pool) error {
	ctx, err := enqueue.InTx(ctx, pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "SELECT 1")
		return err
	})
	if err != nil {
		return err
	}
	fmt.Println(enqueue.TokenFrom(ctx))
	go func() {}()
	return nil
}
`,
	}, {
		File: "types.md", Line: 10,
		Code: "func f() error {\n\treturn consume.NoSuchThing\n}\n",
	}, {
		File: "blank.md", Line: 20,
		Code: "func f() {\n\t_, _ = sign.ParseKeys(\"\")\n}\n",
	}, {
		File: "overwritten.md", Line: 30,
		Code: `func f() ([]sign.Key, error) {
	keys, err := sign.ParseKeys("a")
	more, err := sign.ParseKeys("b")
	return append(keys, more...), err
}
`,
	}, {
		File: "dropped.md", Line: 40,
		Code: "func f(r *outbox.PollingRelay, ctx context.Context) {\n\tr.Run(ctx)\n}\n",
	}, {
		File: "goroutine.md", Line: 50,
		Code: "func f(r *outbox.PollingRelay, ctx context.Context) {\n\tgo r.Run(ctx)\n}\n",
	}, {
		File: "statements.md", Line: 60,
		Code: "x := 1\n",
	}, {
		File: "unused.md", Line: 70,
		Code: "func f() {\n\tx := 1\n}\n",
	}}
	problems, err := CheckSnippets(moduleRoot(t), snippets)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, p := range problems {
		got[p.Pos] += p.Msg + "; "
	}
	want := map[string]string{
		"types.md:11":       "undefined: consume.NoSuchThing",
		"blank.md:21":       "error",
		"overwritten.md:31": "not checked",
		"dropped.md:41":     "not checked",
		"goroutine.md:51":   "loses the error",
		"statements.md:60":  "put statements in a function",
		"unused.md:71":      "declared and not used",
	}
	for pos, msg := range want {
		if !strings.Contains(got[pos], msg) {
			t.Errorf("%s: got %q, want a problem saying %q", pos, got[pos], msg)
		}
	}
	for pos := range got {
		if _, ok := want[pos]; !ok {
			t.Errorf("unexpected problem %s: %s", pos, got[pos])
		}
	}
}
