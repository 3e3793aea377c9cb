package replay

import (
	"log/slog"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/caughtup/caughtup/position"
	"github.com/caughtup/caughtup/testkit/pgtest"
)

// The shared cluster and redis-server start only when an integration test
// asks for them, and are closed before goleak looks for leftover
// goroutines.
func TestMain(m *testing.M) { goleak.VerifyTestMain(pgtest.Wrap(m, pgtest.Options{})) }

const sysID = 0x6f1e2d3c4b5a6978

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func ep(tli uint32) position.Epoch { return position.Epoch{SystemID: sysID, Timeline: tli} }

func lsn(s string) position.LSN { return position.MustParseLSN(s) }

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
}
