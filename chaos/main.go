// Command chaos runs caughtup's fault scenarios on real services, the
// comparison with GitLab-style and time-window policies and the capacity
// simulation; see package chaos/internal/lab for what each does.
//
//	go run ./chaos             # every scenario (make chaos)
//	go run ./chaos -short      # the short version CI runs
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/caughtup/caughtup/chaos/internal/lab"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := lab.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
