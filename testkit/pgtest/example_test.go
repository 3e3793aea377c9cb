package pgtest_test

import (
	"context"
	"fmt"
	"log"

	"github.com/caughtup/caughtup/testkit/pgtest"
)

// A primary with one replica: write on the primary, wait for replay, read on
// the replica.
func ExampleStart() {
	ctx := context.Background()
	c, err := pgtest.Start(ctx, pgtest.Options{Replicas: 1})
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = c.Close() }()

	if err := c.Primary().Exec(ctx, "", "CREATE TABLE t (id int); INSERT INTO t VALUES (1)"); err != nil {
		log.Fatal(err)
	}
	if err := c.WaitReplicasCaughtUp(ctx); err != nil {
		log.Fatal(err)
	}
	replica := c.Replicas()[0]
	pool, err := replica.Pool(ctx, "")
	if err != nil {
		log.Fatal(err)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM t").Scan(&n); err != nil {
		log.Fatal(err)
	}
	tli, err := replica.Timeline(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s sees %d row(s) on timeline %d\n", replica.Name(), n, tli)
	// Output: replica1 sees 1 row(s) on timeline 1
}
