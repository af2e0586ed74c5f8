use Mojo::Base 'basetest';
use testapi;

sub run {
    assert_screen 'terminal', 300;    # boot to the desktop: the xterm has the focus
    mouse_set(1100, 700);             # keep the pointer away from the dialog
    type_string "xmessage -center -buttons Yes:3,No:4 'Save changes?'; echo answer \$? | tee /dev/ttyS1\n";
    assert_screen 'save_dialog', 30;
    assert_and_click 'yes_button';
    assert_screen 'answer_3', 30;
}

sub test_flags { return {fatal => 1} }
1;
