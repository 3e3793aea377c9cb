package main

import (
	"context"
	"io"
)

func runChaos(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return usageError{"chaos: not built yet"}
}
