// Command caughtupvet checks a code base that uses caughtup for mistakes
// the compiler cannot see. Run it through go vet:
//
//	$ go install github.com/caughtup/caughtup/cmd/caughtupvet@latest
//	$ go vet -vettool=$(which caughtupvet) ./...
//
// or by itself, on package patterns: caughtupvet ./...
//
// Its one analyzer, foreigntask, reports each call that hands caughtup's
// asynq client (caughtupasynq.Client) a task built by asynq.NewTask or
// asynq.NewTaskWithHeaders, which the client refuses with
// caughtupasynq.ErrForeignTask at run time whenever the context carries a
// token (see package foreigntask).
package main

import (
	"golang.org/x/tools/go/analysis/singlechecker"

	"github.com/caughtup/caughtup/asynq/caughtupasynq/foreigntask"
)

func main() { singlechecker.Main(foreigntask.Analyzer) }
