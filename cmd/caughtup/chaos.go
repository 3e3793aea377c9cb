package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/caughtup/caughtup/internal/chaos"
)

// errChaosFailed reports a failed chaos run; the suite has already printed
// which check failed.
type errChaosFailed int

func (e errChaosFailed) Error() string {
	return fmt.Sprintf("the suite failed (status %d); see the tables above", int(e))
}

func runChaos(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	// The feed scenarios run publishers as `caughtup feed` processes: this
	// binary, so that no Go toolchain is needed to build one.
	if exe, err := os.Executable(); err == nil && !slices.ContainsFunc(args, func(a string) bool {
		return strings.HasPrefix(strings.TrimLeft(a, "-"), "caughtup")
	}) {
		args = append([]string{"-caughtup", exe}, args...)
	}
	code := chaos.Main(ctx, args, stdout, stderr)
	switch code {
	case 0:
		return nil
	case 2:
		return usageError{"bad flags; see 'caughtup chaos --help'"}
	}
	return errChaosFailed(code)
}
