package enforcer

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/mgpu-dev/mgpu/enforcer/api"
)

// withOnlineOffline sets [defaults] online_offline_switch.
func withOnlineOffline(v string) func(string) string {
	return func(s string) string {
		return strings.Replace(s, "max_instances = 16", "max_instances = 16\nonline_offline_switch = "+v, 1)
	}
}

func classTree(pid, core int, mem uint64, class string) api.CreateRequest {
	r := tree(pid, core, mem)
	r.Class = class
	return r
}

// A device of online_offline_switch 0 refuses offline instances; an
// unknown class is a bad request.
func TestOfflineRefusedWithoutSwitch(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	c := env.client()
	pid := os.Getpid()
	for _, tc := range []struct {
		req    api.CreateRequest
		status int
		want   string
	}{
		{classTree(pid, 10, 1, "offline"), 409, "device 0 does not admit offline instances (online_offline_switch = 0); set online_offline_switch = 1 (or 2) for it in the node config, which applies once the device is empty"},
		{classTree(pid, 10, 1, "batch"), 400, `bad request: unknown priority class "batch" (want online or offline)`},
	} {
		_, err := c.Create(ctx, tc.req)
		var ae *api.Error
		if !errors.As(err, &ae) || ae.Status != tc.status || err.Error() != tc.want {
			t.Errorf("class %s: %v, want %d %q", tc.req.Class, err, tc.status, tc.want)
		}
	}
	in, err := c.Create(ctx, classTree(pid, 10, 1, "online"))
	if err != nil || in.Instance.Class != "online" {
		t.Fatalf("online: %+v, %v", in, err)
	}
}

// With online_offline_switch 1, offline cores are weights among the
// offline instances: they do not count against the online ones' 100, the
// device reports both sums, and the class survives a restart.
func TestOfflineAdmission(t *testing.T) {
	env := newEnv(t, withOnlineOffline("1"))
	_, stop := env.start(t)
	c := env.client()
	pid := os.Getpid()
	for _, r := range []api.CreateRequest{classTree(pid, 60, 1024, ""), classTree(pid, 80, 1024, "offline"), classTree(pid, 40, 1024, "online")} {
		if _, err := c.Create(ctx, r); err != nil {
			t.Fatalf("create %+v: %v", r, err)
		}
	}
	if _, err := c.Create(ctx, classTree(pid, 1, 1, "online")); err == nil ||
		err.Error() != "device 0 has 0% compute free under fixed-share (100% allocated), process tree asks 1%" {
		t.Fatalf("a 101st online percent: %v", err)
	}
	if _, err := c.Create(ctx, classTree(pid, 100, 1, "offline")); err != nil {
		t.Fatalf("an offline 100 beside 100 online: %v", err)
	}
	check := func(when string) {
		t.Helper()
		dev, err := c.Device(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if dev.CoreSum != 100 || dev.CoreFree != 0 || dev.OfflineCoreSum != 180 || dev.OnlineOfflineSwitch != 1 || dev.Instances != 4 {
			t.Fatalf("%s: device %+v", when, dev)
		}
		list, err := c.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var classes []string
		for _, in := range list {
			classes = append(classes, in.Class)
		}
		if strings.Join(classes, ",") != "online,offline,online,offline" {
			t.Fatalf("%s: classes %v", when, classes)
		}
	}
	check("created")
	stop()
	// The config turns the switch off: refused while the instances run.
	env.writeConfig(t, nil)
	env.start(t)
	check("restarted with the switch off in the config")
}
