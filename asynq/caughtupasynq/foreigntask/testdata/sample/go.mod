// A program that uses caughtup's asynq client, for foreigntask's test:
// the test copies it to a temporary directory with the module's go.sum
// and the replace directive pointed at this checkout.
module example.com/sample

go 1.26.0

require (
	github.com/caughtup/caughtup v0.0.0
	github.com/hibiken/asynq v0.26.0
)

replace github.com/caughtup/caughtup => ../../../../..
