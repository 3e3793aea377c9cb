package consume

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/caughtup/caughtup/feed"
	"github.com/caughtup/caughtup/replay"
)

// allowAll is a FleetBudget that is not a pointer type.
type allowAll struct{}

func (allowAll) Allow(context.Context, string) (bool, error) { return true, nil }

// A nil *feed.Budget (what `b, _ := feed.NewBudget(cfg)` leaves after a
// refused config) is a non-nil interface; NewRouter must refuse it rather
// than let the first fallback panic.
func TestConfigRefusesTypedNilFleetBudget(t *testing.T) {
	t.Parallel()
	cfg := func(b FleetBudget) Config {
		return Config{Databases: map[string]replay.Database{"main": {Primary: &pgxpool.Pool{}}}, FleetBudget: b}
	}
	var nilBudget *feed.Budget
	err := cfg(nilBudget).WithDefaults().Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorContains(t, err, "FleetBudget is a nil *feed.Budget")
	require.ErrorContains(t, err, "check its error")

	r, err := NewRouter(t.Context(), cfg(nilBudget))
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Nil(t, r)

	require.NoError(t, cfg(nil).WithDefaults().Validate(), "no budget: the per-process cap alone")
	require.NoError(t, cfg(allowAll{}).WithDefaults().Validate())
	require.NoError(t, cfg(&feed.Budget{}).WithDefaults().Validate())
}
