from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0008_lean_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="prefill_node",
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="prefill_queue",
            field=models.CharField(blank=True, max_length=300),
        ),
    ]
