// Command resolve fetches the PostgreSQL server binaries that
// CAUGHTUP_PG_VERSION selects (16, 17 or 18 come from Maven Central) into
// the harness's cache, so that the first test run does not pay for it,
// and checks that they run. With CAUGHTUP_PG_VERSION empty or 15 it only
// checks Debian's. scripts/install-deps runs it; it is quick when the cache
// is complete.
//
//	CAUGHTUP_PG_VERSION=18 go run ./testkit/pgtest/cmd/resolve
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	began := time.Now()
	v, err := pgtest.ServerVersion(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("pgtest: PostgreSQL %s from %s (%v)\n", v, v.Origin, time.Since(began).Round(time.Millisecond))
}
